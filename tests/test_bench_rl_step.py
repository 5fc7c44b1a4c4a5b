"""The pure parts of `bench.py rl-step` (jaxrl/benchmarks/rl_step.py): run order, medians and
paired ratios, the checks that reject a run, and argument errors answered before JAX loads.
No virtual environment is built and no worker runs here."""

import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.benchmarks import rl_step

sys.path.insert(0, str(rl_step.PEERS_DIR))
import common  # noqa: E402  (the workers' shared module, a script beside them)

ROOT = Path(__file__).resolve().parents[1]
GOOD_WEIGHTS = {"before": [1.0, 2.0], "after": [1.5, 2.5], "peak_rss_gb": 1.0}


def steps(n_warm=2, n=3, lengths=(64, 64)):
    return [{"kind": "step", "step": i, "warmup": i < n_warm, "step_s": 1.0 + i,
             "new_tokens_mean": sum(lengths) / len(lengths), "new_tokens_min": min(lengths),
             "new_tokens_max": max(lengths)} for i in range(n_warm + n)]


def test_rounds_interleave_every_contender_in_turn():
    cs = rl_step.contenders(["periodic", "sync"], ["trl", "tunix"])
    assert [c.name for c in cs] == ["jaxrl-periodic", "jaxrl-sync", "trl", "tunix"]
    assert [c.venv for c in cs] == [None, None, "trl", "tunix"]
    order = rl_step.interleave(["A", "B", "C"], 2)
    assert order == [(0, "A"), (0, "B"), (0, "C"), (1, "A"), (1, "B"), (1, "C")]


def test_micro_batch_rows_pass_the_setting_to_the_worker():
    cs = rl_step.contenders(["sync"], ["trl"], [1, 4])
    assert [(c.name, c.args) for c in cs] == [
        ("jaxrl-sync", ("sync", "1")), ("jaxrl-sync-mb4", ("sync", "4")), ("trl", ())]
    assert rl_step.parse(["--micro-batches", "1,2,4"]).micro_batches == [1, 2, 4]


def test_trl_without_gradient_checkpointing_is_its_own_peer_row():
    cs = rl_step.contenders(["sync"], ["trl", "trl-nogc"])
    assert [(c.name, c.worker, c.args, c.venv) for c in cs[1:]] == [
        ("trl", "trl_worker.py", (), "trl"),
        ("trl-nogc", "trl_worker.py", ("--no-gradient-checkpointing",), "trl")]
    assert rl_step.parse(["--vs", "trl-nogc"]).vs == ["trl-nogc"]


def test_remat_rows_pass_the_setting_to_the_worker():
    cs = rl_step.contenders(["sync"], ["trl"], [4], "full")
    assert [(c.name, c.args) for c in cs] == [
        ("jaxrl-sync-mb4-remat-full", ("sync", "4", "full")), ("trl", ())]
    assert rl_step.parse([]).remat == "none"


def test_share_prompts_rows_pass_the_setting_to_the_worker():
    cs = rl_step.contenders(["sync"], [], [4], "none", "both")
    assert [(c.name, c.args) for c in cs] == [
        ("jaxrl-sync-mb4", ("sync", "4")),
        ("jaxrl-sync-mb4-noshare", ("sync", "4", "none", "noshare"))]
    cs = rl_step.contenders(["sync"], [], [1], "full", "off")
    assert [(c.name, c.args) for c in cs] == [
        ("jaxrl-sync-remat-full-noshare", ("sync", "1", "full", "noshare"))]
    assert rl_step.parse([]).share_prompts == "on"
    assert rl_step.parse(["--share-prompts", "both"]).share_prompts == "both"


def test_medians_and_paired_ratios():
    times = {("jaxrl-sync", 0): 10.0, ("trl", 0): 20.0, ("jaxrl-sync", 1): 30.0,
             ("trl", 1): 20.0, ("jaxrl-sync", 2): 12.0, ("trl", 2): 16.0}
    rows = [dict(name=n, round=r, step_s=t, gen_s=t / 2, train_s=t / 2, peak_rss_gb=r + 1.0,
                 problems=[]) for (n, r), t in times.items()]
    rows.append(dict(name="trl", round=3, step_s=1.0, gen_s=None, train_s=None,
                     peak_rss_gb=None, problems=["weights unchanged"]))  # invalid: left out
    s = rl_step.summarize(rows, ["jaxrl-sync", "trl"])
    assert s["contenders"]["jaxrl-sync"]["step_s"] == 12.0  # median of 10, 30, 12
    assert s["contenders"]["trl"]["step_s"] == 20.0  # 20, 20, 16 (not the failed 1.0)
    assert s["contenders"]["trl"]["rounds"] == 3
    assert s["contenders"]["trl"]["peak_rss_gb"] == 2.0
    ratio = s["ratios"]["jaxrl-sync/trl"]
    assert ratio["paired"] == pytest.approx([0.5, 1.5, 0.75])
    assert ratio["median"] == pytest.approx(0.75)  # not 12 / 20 = 0.6, the ratio of medians


def test_a_valid_run_passes_the_checks():
    assert rl_step.check_row(steps(), GOOD_WEIGHTS, new_tokens=64, measured=3,
                             saved=[1.0, 2.0]) == []


@pytest.mark.parametrize("case, expect", [
    ("short_sample", "new tokens per sample in [63, 64]"),
    ("short_mean", "on average"),
    ("missing_step", "2 measured steps reported, expected 3"),
    ("unchanged", "weights unchanged"),
    ("other_weights", "differs from the saved"),
    ("no_checksum", "no parameter checksums"),
])
def test_a_bad_run_is_rejected(case, expect):
    rows, weights, saved = steps(), dict(GOOD_WEIGHTS), [1.0, 2.0]
    if case == "short_sample":  # one sample stopped early; the mean alone could hide it
        rows[-1].update(new_tokens_min=63, new_tokens_mean=64.0)
    elif case == "short_mean":
        rows[-1].update(new_tokens_mean=63.5)
        del rows[-1]["new_tokens_min"], rows[-1]["new_tokens_max"]
    elif case == "missing_step":
        rows = rows[:-1]
    elif case == "unchanged":
        weights["after"] = list(weights["before"])
    elif case == "other_weights":
        saved = [1.0, 2.1]
    elif case == "no_checksum":
        weights = None
    problems = rl_step.check_row(rows, weights, new_tokens=64, measured=3, saved=saved)
    assert any(expect in p for p in problems), problems


def test_worker_lines_are_read_from_noisy_stdout():
    text = ("loading...\n" + 'RLSTEP {"kind": "step", "step": 0, "warmup": true}\n'
            "warning: something\n" + 'RLSTEP {"kind": "weights", "before": [1, 2]}\n')
    rows, weights = rl_step.parse_lines(text)
    assert rows == [{"kind": "step", "step": 0, "warmup": True}]
    assert weights == {"kind": "weights", "before": [1, 2]}


def test_checksum_is_layout_free_and_sees_an_update():
    rng = np.random.default_rng(0)
    q, k = rng.normal(size=(8, 4)).astype(np.float32), rng.normal(size=(8, 2)).astype(np.float32)
    fused = np.concatenate([q, k], axis=1).T  # another framework's layout of the same weights
    assert common.checksum([q, k]) == pytest.approx(common.checksum([fused]), rel=1e-12)
    moved = q.copy()
    moved[0, 0] += 1e-3
    assert common.checksum([moved, k]) != common.checksum([q, k])


def test_workload_text():
    prompts = rl_step.prompt_texts()
    assert len(prompts) == 16 and len(set(prompts)) == 16
    assert all(len(p.encode()) == rl_step.PROMPT_TOKENS for p in prompts)  # one byte, one id
    table = rl_step.bytes_to_unicode()
    assert sorted(table) == list(range(256)) and len(set(table.values())) == 256
    assert common.lowercase_share("ab1 ") == 0.5 and common.lowercase_share("") == 0.0


@pytest.mark.parametrize("argv, message", [
    (["--vs", "ray"], "--vs takes distinct names from trl,trl-nogc,tunix,none"),
    (["--modes", "sync,sync"], "--modes takes distinct names"),
    (["--rounds", "0"], "--rounds must be >= 1"),
    (["--shape", "7b"], "invalid choice"),
    (["--micro-batches", "3"], "--micro-batches takes distinct divisors of the 128 rows"),
    (["--micro-batches", "4,4"], "--micro-batches takes distinct divisors"),
    (["--remat", "half"], "argument --remat: invalid choice: 'half'"),
    (["--share-prompts", "yes"], "argument --share-prompts: invalid choice: 'yes'"),
])
def test_argument_errors_come_before_jax(argv, message):
    code = ("import sys; sys.path.insert(0, 'launch'); import bench\n"
            "try:\n    bench.main(['rl-step', *sys.argv[1:]])\n"
            "except SystemExit as e:\n    print('exit', e.code, 'jax' in sys.modules)\n")
    p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                       cwd=ROOT, timeout=60)
    assert p.stdout.strip() == "exit 2 False", p.stdout + p.stderr
    assert message in p.stderr
