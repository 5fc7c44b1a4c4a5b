"""The pure parts of `bench.py generate --vs hf,ct2` (jaxrl/benchmarks/generate_peers.py): peer
names, run order, the checks that reject a run, medians and paired ratios, greedy agreement,
and argument errors answered before JAX loads. No virtual environment is built, no worker runs."""

import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.benchmarks import generate, generate_peers

ROOT = Path(__file__).resolve().parents[1]


def test_peer_names_expand_in_run_order():
    assert generate_peers.parse_vs("ct2,hf") == ["hf", "ct2-f32", "ct2-int8"]
    assert generate_peers.parse_vs("ct2-int8") == ["ct2-int8"]
    assert generate_peers.parse_vs("ct2, ct2-f32") == ["ct2-f32", "ct2-int8"]
    assert generate_peers.parse_vs("none") == []
    for bad in ("vllm", "hf,tgi", "", "none,hf"):
        with pytest.raises(ValueError, match="hf,ct2,ct2-f32,ct2-int8"):
            generate_peers.parse_vs(bad)


def test_contenders_and_interleaving():
    cs = generate_peers.contenders(["hf", "ct2-f32", "ct2-int8"], "int8")
    assert [(c.name, c.worker, c.args, c.venv) for c in cs] == [
        ("jaxrl", "gen_jaxrl_worker.py", ("none",), None),
        ("jaxrl-int8", "gen_jaxrl_worker.py", ("int8",), None),
        ("hf", "gen_hf_worker.py", (), "trl"),
        ("ct2-f32", "gen_ct2_worker.py", ("f32",), "ct2"),
        ("ct2-int8", "gen_ct2_worker.py", ("int8",), "ct2")]
    assert [c.name for c in generate_peers.contenders(["hf"], "none")] == ["jaxrl", "hf"]
    w8a8 = generate_peers.contenders(["ct2-int8"], "w8a8")[1]
    assert (w8a8.name, w8a8.args) == ("jaxrl-w8a8", ("w8a8",))
    order = generate_peers.rl_step.interleave(["A", "B", "C"], 2)
    assert [x for _, x in order] == ["A", "B", "C", "A", "B", "C"]
    for c in cs:  # every worker the driver names exists beside common.py
        assert (generate_peers.rl_step.PEERS_DIR / c.worker).is_file()


def test_worker_lines_and_run_checks():
    out = "\n".join(["noise", 'RLSTEP {"kind": "greedy", "tokens": [[1, 2]]}',
                     'RLSTEP {"kind": "run", "total_s": 2.0, "samples": 4, "new_min": 8, '
                     '"new_max": 8}', "RLSTEPX not ours"])
    lines = generate_peers.parse_lines(out)
    assert lines["greedy"][0]["tokens"] == [[1, 2]] and len(lines["run"]) == 1
    runs = lines["run"]
    assert generate_peers.check_runs(runs, repeats=1, batch=4, new_tokens=8) == []
    short = [dict(runs[0], new_min=7)]  # one sample stopped early
    assert "in [7, 8], expected exactly 8" in generate_peers.check_runs(
        short, repeats=1, batch=4, new_tokens=8)[0]
    assert "3 samples" in generate_peers.check_runs(
        [dict(runs[0], samples=3)], repeats=1, batch=4, new_tokens=8)[0]
    assert generate_peers.check_runs([], repeats=2, batch=4, new_tokens=8) == [
        "0 timed runs reported, expected 2"]


def test_round_row_medians_and_paired_ratios():
    # one worker's timed runs: 64 tokens in 2 s, 1 s, 4 s -> 32, 64, 16 tok/s -> median 32
    runs = [{"total_s": t} for t in (2.0, 1.0, 4.0)]
    row = generate_peers.round_row("jaxrl", 0, runs, [], tokens=64, load=(1.0, 2.0), wall_s=9.0)
    assert row["tokens_per_s"] == 32.0 and (row["load_before"], row["load_after"]) == (1.0, 2.0)
    rates = {("jaxrl", 0): 300.0, ("hf", 0): 100.0, ("ct2-f32", 0): 400.0,
             ("jaxrl", 1): 200.0, ("hf", 1): 250.0, ("ct2-f32", 1): 250.0,
             ("jaxrl", 2): 330.0, ("hf", 2): 220.0, ("ct2-f32", 2): 300.0}
    rows = [dict(name=n, round=r, tokens_per_s=v, problems=[]) for (n, r), v in rates.items()]
    rows.append(dict(name="hf", round=3, tokens_per_s=1e6, problems=["exit code 1"]))  # dropped
    s = generate_peers.summarize(rows, ["jaxrl", "hf", "ct2-f32"])
    assert s["contenders"]["jaxrl"] == {"tokens_per_s": 300.0, "rounds": 3}
    assert s["contenders"]["hf"] == {"tokens_per_s": 220.0, "rounds": 3}
    hf = s["ratios"]["jaxrl/hf"]
    assert hf["paired"] == pytest.approx([3.0, 0.8, 1.5])
    assert hf["median"] == pytest.approx(1.5)  # not 300 / 220 = 1.36, the ratio of medians
    ct2 = s["ratios"]["jaxrl/ct2-f32"]
    assert ct2["paired"] == pytest.approx([0.75, 0.8, 1.1])
    assert ct2["median"] == pytest.approx(0.8)
    assert set(s["ratios"]) == {"jaxrl/hf", "jaxrl/ct2-f32"}  # no peer/peer ratios


def test_greedy_agreement():
    ref = [[1, 2, 3], [4, 5, 6], [7, 8, 9]]
    got = [[1, 2, 3], [4, 0, 6], [7, 8]]
    assert generate_peers.greedy_agreement(ref, got) == {
        "prompts": 3, "equal": 1, "first_diff": [1, 2]}
    assert generate_peers.greedy_agreement(ref, ref)["equal"] == 3


def test_vs_selects_the_harness():
    assert not generate.isolated(generate._parse(["--vs", "hf"]))  # in process, as before
    assert generate.isolated(generate._parse(["--vs", "hf,ct2"]))
    assert generate.isolated(generate._parse(["--vs", "hf", "--isolated"]))
    assert generate._parse(["--vs", "hf"]).vs == "hf"


@pytest.mark.parametrize("argv, expect", [
    (["--vs", "hf,vllm"], "got 'hf,vllm'"),
    (["--vs", "ct2", "--rounds", "0"], "--rounds must be >= 1, got 0"),
    (["--vs", "ct2", "--vocab", "100"], "--vocab must be >= 259, got 100"),
])
def test_cli_errors_before_jax(argv, expect):
    code = ("import sys; from jaxrl.benchmarks import generate\n"
            "try:\n    generate.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert 'jax' not in sys.modules, 'JAX imported before the argument error'\n"
            "    raise\n")
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    assert expect in res.stderr


def test_ct2_pin_matches_the_bench_extra():
    import tomllib

    extra = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"][
        "optional-dependencies"]["bench"]
    assert f"ctranslate2=={generate_peers.CT2_VERSION}" in extra
    assert f"ctranslate2=={generate_peers.CT2_VERSION}" in generate_peers.venv_specs()["ct2"]
