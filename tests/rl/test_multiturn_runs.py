"""Whole runs with multi-turn episodes: SIGKILL then --resume (each mode runs with episodes in
tests/rl/test_run.py's mode matrix)."""

import dataclasses
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from run_helpers import has_sealed_checkpoint
from tiny_multiturn_config import tiny_multiturn_run_config

from jaxrl.rl.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]
SMALL = dict(prompts_per_step=2, group_size=2)


def _launch(tmp_path, *extra):
    args = [sys.executable, str(ROOT / "launch" / "run.py"), "--quiet",
            "--config", str(Path(__file__).parent / "tiny_multiturn_config.py"),
            f"--run_dir={tmp_path / 'runs'}", "--name=victim", "--pipeline.steps=5",
            "--train.checkpoint_every=2", "--data.prompts_per_step=2", "--data.group_size=2",
            f"--data.sft.cache_dir={tmp_path / 'cache'}", *extra]
    env = dict(os.environ, JAXRL_CPU_DEVICES="2",
               JAXRL_TEST_EPISODE_LOG=str(tmp_path / "episodes.log"))
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path)


def _batches(tmp_path, per_batch):
    """{pid: [[uid, ...] per batch]} from the episode log, in the order the episodes began."""
    by_pid = {}
    for line in (tmp_path / "episodes.log").read_text().splitlines():
        pid, uid = line.split()
        by_pid.setdefault(pid, []).append(uid)
    return {pid: [uids[i:i + per_batch] for i in range(0, len(uids) - per_batch + 1, per_batch)]
            for pid, uids in by_pid.items()}


@pytest.mark.slow
def test_sigkill_then_resume_multiturn_takes_each_item_once(tmp_path):
    from jaxrl.data.pipeline import PromptIterator
    from jaxrl.data.tasks import build_task

    victim = _launch(tmp_path)
    metrics = tmp_path / "runs" / "victim" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:  # kill after step 2 was logged (checkpoint at step 1 exists)
        if (metrics.exists() and len(metrics.read_text().splitlines()) >= 3
                and has_sealed_checkpoint(metrics.parent)):
            break
        if victim.poll() is not None:
            pytest.fail("the run ended before it could be killed:\n" + victim.stdout.read()[-3000:])
        time.sleep(0.2)
    victim.send_signal(signal.SIGKILL)
    victim.wait()
    resumed = _launch(tmp_path, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    rows = read_metrics(tmp_path / "runs" / "victim")
    assert [r["step"] for r in rows] == list(range(5))  # each step once, continuing
    assert [r["data/prompts_consumed"] for r in rows] == [2.0 * (s + 1) for s in range(5)]
    assert all(r["env/turns_mean"] == 2.0 for r in rows)

    # the items: the killed run's batches up to the checkpoint, then the resumed run's, are
    # exactly the uninterrupted order (each item of a group is one episode per sample)
    cfg = tiny_multiturn_run_config(tmp_path, data=SMALL).data
    task = build_task(dataclasses.replace(cfg, task="lookup"))
    order = PromptIterator(task.source("train"), prompts_per_step=2, seed=cfg.seed,
                           epochs=cfg.epochs, shuffle=cfg.shuffle)
    expected = [[r["uid"] for r in next(order) for _ in range(2)] for _ in range(5)]
    first, second = _batches(tmp_path, per_batch=4).values()
    start = expected.index(second[0])  # the resumed run's first batch
    assert 1 <= start <= 4  # it restored a checkpoint, and started after it
    assert first[:start] == expected[:start]
    assert second == expected[start:]
