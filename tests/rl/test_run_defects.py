"""Defects a review found in the run's wiring, each with the behaviour that fixes it."""

import contextlib
import io
import json
import math
import os
import re
import runpy
import subprocess
import sys
import types
from pathlib import Path

import pytest
from run_helpers import tiny_run_config

import jaxrl.run
from jaxrl.config import ConfigError, RunConfig, TrainConfig
from jaxrl.rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def features_run(tmp_path_factory):
    """One run shared by the checks below that need a whole run but not a run of their own
    (docs/testing.md): a KL penalty against the frozen reference, evaluation every step (the
    engines made are counted), samples every 2 steps, the memory check in `warn` mode under a
    budget the run cannot meet, the progress display on (stderr captured); then `resume=True` on
    the finished run."""
    from jaxrl.generate import engine as engine_mod

    cfg = tiny_run_config(
        tmp_path_factory.mktemp("features"), train=dict(kl_coef=0.05, entropy_coef=0.05, lr=1e-2),
        data=dict(eval_every=1), pipeline=dict(samples_every=2),
        mesh=dict(memory_budget_gib=0.0001, memory_check="warn"))
    made, real_init = [], engine_mod.JaxEngine.__init__

    def counting(self, *a, **k):
        made.append(1)
        real_init(self, *a, **k)

    err = io.StringIO()
    with pytest.MonkeyPatch.context() as mp, contextlib.redirect_stderr(err):
        mp.setattr(engine_mod.JaxEngine, "__init__", counting)
        result = jaxrl.run.run(cfg)  # with the progress display
        engines = len(made)
        again = jaxrl.run.run(cfg, resume=True, progress=False)
    return types.SimpleNamespace(cfg=cfg, result=result, rows=read_metrics(result.run_dir),
                                 engines=engines, err=err.getvalue(), again=again)


def test_bad_reference_directory_is_a_config_error_before_jax(tmp_path):
    with pytest.raises(ConfigError, match=r"train.ref_init='.*nowhere' is not a Hugging Face"):
        RunConfig(train=TrainConfig(kl_coef=0.05, ref_init=str(tmp_path / "nowhere")))
    out = subprocess.run([sys.executable, "launch/run.py", "--train.kl_coef=0.05",
                          f"--train.ref_init={tmp_path / 'nowhere'}"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: train.ref_init=" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.slow
def test_kl_coef_runs_against_a_frozen_reference(features_run):
    """`--train.kl_coef` used to end in a traceback (no reference policy was ever built)."""
    # the tiny random policy solves nothing (zero advantages): an entropy bonus moves it
    rows = features_run.rows
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert rows[0]["loss/kl"] == pytest.approx(0.0, abs=1e-6)  # the policy is the reference
    assert all(r["loss/kl"] > 0 and r["policy/ref_kl"] > 0 for r in rows[1:])


def test_cross_section_checks_name_the_keys_and_the_fix():
    with pytest.raises(ConfigError, match=r"train.total_steps=10 .*pipeline.steps=40.*"
                                          r"--train.total_steps=40"):
        RunConfig(train=TrainConfig(schedule="cosine", total_steps=10))
    with pytest.raises(ConfigError, match=r"train.micro_batches=128 .* rollouts per step"):
        RunConfig(train=TrainConfig(micro_batches=128))


@pytest.mark.slow
def test_skipped_update_keeps_checkpoints_on_pipeline_steps(tmp_path, monkeypatch):
    """nan_policy=skip: TrainState.step counts applied updates, the run counts pipeline steps;
    checkpoints and --resume follow the pipeline (no step is repeated after a resume)."""
    import jax.numpy as jnp

    from jaxrl.train.checkpoint import Checkpointer
    from jaxrl.train.trainer import Trainer

    real_prepare, calls = Trainer._prepare, []

    def poisoned(self, batch, **kw):  # the second update's rewards turn NaN on the device
        out, *rest = real_prepare(self, batch, **kw)  # the device batch first
        calls.append(1)
        return (out.replace(rewards=out.rewards * jnp.nan) if len(calls) == 2 else out), *rest

    monkeypatch.setattr(Trainer, "_prepare", poisoned)
    cfg = tiny_run_config(tmp_path, pipeline=dict(steps=4),
                          train=dict(nan_policy="skip", checkpoint_every=1))
    run_dir = jaxrl.run.run(cfg, progress=False, evaluate=False).run_dir
    rows = read_metrics(run_dir)
    assert [r["train/nonfinite"] for r in rows] == [0, 1, 0, 0]
    assert all(math.isfinite(r["loss/total"]) for i, r in enumerate(rows) if i != 1)
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=5, use_async=False)
    try:
        assert ckpt.latest_step() == 4  # 4 pipeline steps, 3 applied updates
    finally:
        ckpt.close()
    longer = tiny_run_config(tmp_path, pipeline=dict(steps=5),
                             train=dict(nan_policy="skip", checkpoint_every=1))
    jaxrl.run.run(longer, resume=True, progress=False, evaluate=False)
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2, 3, 4]


@pytest.mark.slow
def test_sft_launcher_starts_no_sandbox_pool_for_a_task_without_code(tmp_path, monkeypatch,
                                                                    capsys):
    import jaxrl.sandbox.pool

    def no_pool(*a, **k):
        raise AssertionError("a sandbox pool was started for a task whose rewards run no code")

    monkeypatch.setattr(jaxrl.sandbox.pool, "LocalSandboxPool", no_pool)
    module = runpy.run_path(str(ROOT / "launch" / "sft.py"), run_name="launch_sft")
    module["main"]([str(ROOT / "configs" / "arith.py"), "--data.sft.steps=2",
                    "--data.sft.batch_size=4", "--data.sft.cache=false", "--data.eval_size=2",
                    "--data.pass_k=1"])
    assert '"sandbox_tier": null' in capsys.readouterr().out


@pytest.mark.slow
def test_mid_run_evaluation_uses_the_run_engine_and_one_schema(features_run):
    result, rows = features_run.result, features_run.rows
    assert features_run.engines == 1  # before, during and after RL: the run's one engine
    schema = {k for k in result.eval_start if k.startswith("eval/")}
    assert schema == {k for k in result.eval_end if k.startswith("eval/")}
    assert {"eval/pass@1", "eval/prompts", "eval/reward_errors", "eval/time_s"} <= schema
    for row in rows:  # steps 0 and 1 mid-run, step 2 the end evaluation
        assert {k for k in row if k.startswith("eval/")} == schema, row["step"]


@pytest.mark.slow
def test_a_run_logs_the_before_rl_evaluation_at_step_0_and_samples(features_run):
    from test_progress import _texts

    result, rows, cfg = features_run.result, features_run.rows, features_run.cfg
    assert {k: rows[0][k] for k in result.eval_start} == result.eval_start  # before RL: step 0
    assert {k: rows[-1][k] for k in result.eval_end} == result.eval_end  # after RL: the last
    first, last = (f"{result.eval_start['eval/pass@1']:.4g}",
                   f"{result.eval_end['eval/pass@1']:.4g}")
    assert re.search(rf"pass@1\s+{re.escape(first)}\s+{re.escape(last)}\s", result.summary)
    samples = [json.loads(x) for x in (result.run_dir / "samples.jsonl").read_text().splitlines()]
    assert {s["step"] for s in samples} == {1}  # rows whose (step + 1) % 2 == 0
    assert all(set(s) == {"step", "prompt", "completion", "reward"} for s in samples)
    assert all(s["prompt"] and 0.0 <= s["reward"] <= 1.0 for s in samples)
    texts = _texts(result.run_dir)
    assert json.loads(texts["config/text_summary"][0][1].strip("`\n"))["name"] == cfg.name
    err = features_run.err
    assert re.search(r"^eval@0 \d+/\d+ \| ", err, re.M)  # the before-RL evaluation shows
    assert [int(s) for s in re.findall(r"^RL \d+/3 \| step (\d+)", err, re.M)] == [0, 1, 2]
    assert "is complete at step 2 (3 steps); nothing to do" in features_run.again.summary


def test_a_run_that_does_not_fit_stops_before_any_work(tmp_path):
    cfg = tiny_run_config(tmp_path, mesh=dict(memory_budget_gib=0.0001))
    with pytest.raises(ConfigError, match=r"(?s)the run does not fit in device memory:.*"
                                          r"settings that would make it fit"):
        jaxrl.run.run(cfg, progress=False)
    # Nothing written: a corrected rerun finds no half-started run to set aside.
    assert not (tmp_path / "runs" / "t").exists()


@pytest.mark.slow
def test_memory_check_warn_runs_a_plan_that_does_not_fit(features_run):
    # the shared run's budget (0.0001 GiB) stops a run in the default `error` mode (above)
    assert features_run.cfg.mesh.memory_check == "warn"
    assert len(features_run.result.history) == 3
