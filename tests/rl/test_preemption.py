"""A signal during the RL steps stops the run at the next safe point with a checkpoint at the last
finished step, within `preemption_grace_s` (SIGTERM used to keep only the last periodic
checkpoint, so up to `train.checkpoint_every - 1` steps were redone; before that it killed the
process with rc -15 mid-write). The end-to-end test also holds what test_sigterm.py checked:
exit 143 with the line saying to --resume, nothing of the run left running, every metrics row
once after the resume (a row written between two checkpoints used to be lost)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from fake_loop import batch, fake_loop

from jaxrl.rl.metrics import read_metrics
from jaxrl.rl.stopping import Stopping, Terminated

ROOT = Path(__file__).resolve().parents[2]

# The tiny run, its steps slowed by an in-process reward that sleeps and scores 0 (so a signal
# lands mid-step): ~0.3 s a step.
CONFIG = """
import dataclasses, sys, time
from pathlib import Path
sys.path.insert(0, {helpers!r})
from run_helpers import tiny_run_config


def config():
    from jaxrl.data import tasks
    from jaxrl.rewards.rewards import register_reward

    @register_reward("test_slow_zero", overwrite=True, isolated=False)
    def slow_zero(prompt, completion, **fields):
        time.sleep(0.02)
        return 0.0

    real = tasks.build_task
    tasks.build_task = lambda cfg: dataclasses.replace(
        real(cfg), rewards={{**real(cfg).rewards, "test_slow_zero": 0.5}})
    return tiny_run_config(Path("."), name="slow")
"""


def _launch(tmp_path, name, *extra):
    config = tmp_path / "slow_config.py"
    config.write_text(CONFIG.format(helpers=str(Path(__file__).parent)))
    env = dict(os.environ, JAXRL_CPU_DEVICES="2", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "run.py"), "--quiet", "--config", str(config),
         f"--run_dir={tmp_path / 'runs'}", f"--name={name}",
         f"--data.sft.cache_dir={tmp_path / 'cache'}", "--pipeline.steps=8",
         "--train.checkpoint_every=5", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=tmp_path,
        start_new_session=True)


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_the_last_finished_step_and_resumes_exactly(tmp_path):
    ref = _launch(tmp_path, "ref")
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out[-3000:]
    victim = _launch(tmp_path, "victim")
    metrics = tmp_path / "runs" / "victim" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        if victim.poll() is not None or time.time() > deadline:
            pytest.fail("the run ended before the signal:\n" + victim.communicate()[0][-3000:])
        time.sleep(0.05)
    victim.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, _ = victim.communicate(timeout=120)
    assert victim.returncode == 143, out[-3000:]
    assert time.time() - t0 < 30, "past the grace period (preemption_grace_s=30)"
    found = re.search(r"terminated \(SIGTERM\): stopped cleanly, checkpoint at step (\d+) \(the "
                      r"last finished step\); continue with --resume", out)
    assert found, out[-3000:]
    step = int(found.group(1))
    time.sleep(1)
    left = subprocess.run(["pgrep", "-s", str(victim.pid)], capture_output=True, text=True)
    assert not left.stdout.strip(), f"processes of the run outlived it: {left.stdout}"
    run_dir = tmp_path / "runs" / "victim"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(step))  # every row, whole
    assert 2 <= step < 8 and step != 5, "not a periodic checkpoint"
    assert (run_dir / "checkpoints" / str(step) / "jaxrl_integrity.json").is_file()
    resumed = _launch(tmp_path, "victim", "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    rows, ref_rows = read_metrics(run_dir), read_metrics(tmp_path / "runs" / "ref")
    assert [r["step"] for r in rows] == list(range(8))
    for key in ("data/prompts_consumed", "reward/mean", "loss/total"):
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key


def _pipeline(stopping, produce_s):
    def produce(step, weights):
        time.sleep(produce_s)
        return batch(step, step, num_rollouts=1, busy_s=produce_s)

    return fake_loop("sync", produce=produce, train=lambda step, p: ({}, {}), initial_params={},
                     publish=lambda params, version: (params, {}))


@pytest.mark.parametrize("signum, kind", [(signal.SIGTERM, Terminated),
                                          (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_while_waiting_for_a_batch_saves_the_finished_steps(signum, kind):
    stopping, saved = Stopping(5.0), []
    undo = stopping.install()
    try:
        pipeline = _pipeline(stopping, produce_s=0.3)
        threading.Timer(1.0, lambda: signal.raise_signal(signum)).start()  # during step 3
        with pytest.raises(kind, match=r"checkpoint at step \d \(the last finished step\)") as e:
            with stopping.deferred(save=saved.append):
                pipeline.run(start_step=0, num_steps=50, should_stop=stopping.requested)
    finally:
        undo()
    assert type(e.value) is kind and len(saved) == 1 and 1 <= saved[0] <= 5
    assert f"step {saved[0]} " in str(e.value)


def test_no_grace_or_outside_the_steps_stops_at_once():
    for stopping in (Stopping(0.0), Stopping(5.0)):
        undo = stopping.install()
        try:
            with pytest.raises(Terminated):
                if stopping.grace_s:  # not inside deferred(): start-up, SFT, first evaluation
                    signal.raise_signal(signal.SIGTERM)
                else:
                    with stopping.deferred(save=lambda n: pytest.fail("no time to save")):
                        signal.raise_signal(signal.SIGTERM)
        finally:
            undo()


def test_no_safe_point_within_the_grace_period_stops_without_a_checkpoint():
    stopping = Stopping(1.0)
    undo = stopping.install()
    t0 = time.monotonic()
    try:
        with pytest.raises(Terminated, match="no safe point within the grace period"):
            with stopping.deferred(save=lambda n: pytest.fail("no safe point was reached")):
                signal.raise_signal(signal.SIGTERM)
                time.sleep(30)  # a step that does not end
    finally:
        undo()
    assert time.monotonic() - t0 < 10


def test_the_grace_period_is_a_finite_number_of_seconds():
    from jaxrl.config import ConfigError, RunConfig

    assert RunConfig().preemption_grace_s == 30.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="preemption_grace_s"):
            RunConfig(preemption_grace_s=bad)
