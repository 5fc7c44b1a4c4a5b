"""Defects a review found in the run's wiring, each with the behaviour that fixes it."""

import os
import runpy
import subprocess
import sys
from pathlib import Path

import pytest
from run_helpers import tiny_run_config

import jaxrl.run
from jaxrl.config import ConfigError, RunConfig, TrainConfig
from jaxrl.rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


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
def test_kl_coef_runs_against_a_frozen_reference(tmp_path):
    """`--train.kl_coef` used to end in a traceback (no reference policy was ever built)."""
    # the tiny random policy solves nothing (zero advantages): an entropy bonus moves it
    cfg = tiny_run_config(tmp_path, train=dict(kl_coef=0.05, entropy_coef=0.05, lr=1e-2))
    rows = read_metrics(jaxrl.run.run(cfg, progress=False, evaluate=False).run_dir)
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
    assert [r["train/nonfinite"] for r in read_metrics(run_dir)] == [0, 1, 0, 0]
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
def test_mid_run_evaluation_uses_the_run_engine_and_one_schema(tmp_path, monkeypatch):
    from jaxrl.generate import engine as engine_mod

    made = []
    real_init = engine_mod.JaxEngine.__init__

    def counting(self, *a, **k):
        made.append(1)
        real_init(self, *a, **k)

    monkeypatch.setattr(engine_mod.JaxEngine, "__init__", counting)
    cfg = tiny_run_config(tmp_path, data=dict(eval_every=1))
    result = jaxrl.run.run(cfg, progress=False)
    rows = read_metrics(result.run_dir)
    assert len(made) == 1  # before, during and after RL: the run's one engine
    schema = {k for k in result.eval_start if k.startswith("eval/")}
    assert schema == {k for k in result.eval_end if k.startswith("eval/")}
    assert {"eval/pass@1", "eval/prompts", "eval/reward_errors", "eval/time_s"} <= schema
    for row in rows:  # steps 0 and 1 mid-run, step 2 the end evaluation
        assert {k for k in row if k.startswith("eval/")} == schema, row["step"]


def test_a_run_that_does_not_fit_stops_before_any_work(tmp_path):
    cfg = tiny_run_config(tmp_path, mesh=dict(memory_budget_gib=0.0001))
    with pytest.raises(ConfigError, match=r"(?s)the run does not fit in device memory:.*"
                                          r"settings that would make it fit"):
        jaxrl.run.run(cfg, progress=False)
    # Nothing written: a corrected rerun finds no half-started run to set aside.
    assert not (tmp_path / "runs" / "t").exists()
    warn = tiny_run_config(tmp_path, name="w", pipeline=dict(steps=1),
                           mesh=dict(memory_budget_gib=0.0001, memory_check="warn"))
    assert len(jaxrl.run.run(warn, progress=False, evaluate=False).history) == 1
