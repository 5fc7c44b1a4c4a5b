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
from jaxrl.controller.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def test_kl_coef_without_a_reference_policy_is_a_config_error():
    with pytest.raises(ConfigError, match=r"train.kl_coef=0.05 needs a frozen reference policy"):
        RunConfig(train=TrainConfig(kl_coef=0.05))
    out = subprocess.run([sys.executable, "launch/run.py", "--train.kl_coef=0.05"], cwd=ROOT,
                         capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert out.returncode == 2, out.stderr[-2000:]
    assert "error: train.kl_coef=0.05 needs a frozen reference policy" in out.stderr
    assert "Traceback" not in out.stderr


def test_cross_section_checks_name_the_keys_and_the_fix():
    with pytest.raises(ConfigError, match=r"train.total_steps=10 .* pipeline.steps=40.*"
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

    real_prepare, calls = Trainer.prepare, []

    def poisoned(self, batch):  # the second update's rewards turn NaN on the device
        out = real_prepare(self, batch)
        calls.append(1)
        return out.replace(rewards=out.rewards * jnp.nan) if len(calls) == 2 else out

    monkeypatch.setattr(Trainer, "prepare", poisoned)
    cfg = tiny_run_config(tmp_path, pipeline=dict(steps=4),
                          train=dict(nan_policy="skip", checkpoint_every=1))
    run_dir = jaxrl.run.run(cfg, progress=False, evaluate=False).run_dir
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
    import jaxrl.rewards.pool

    def no_pool(*a, **k):
        raise AssertionError("a sandbox pool was started for a task whose rewards run no code")

    monkeypatch.setattr(jaxrl.rewards.pool, "LocalSandboxPool", no_pool)
    module = runpy.run_path(str(ROOT / "launch" / "sft.py"), run_name="launch_sft")
    module["main"]([str(ROOT / "configs" / "arith.py"), "--data.sft.steps=2",
                    "--data.sft.batch_size=4", "--data.sft.cache=false", "--data.eval_size=2",
                    "--data.pass_k=1"])
    assert '"sandbox_tier": null' in capsys.readouterr().out
