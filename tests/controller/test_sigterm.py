"""SIGTERM (a preemption notice) stops a run as cleanly as Ctrl-C: it used to kill the process
with rc -15 mid-write."""

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from jaxrl.controller.metrics import read_metrics

ROOT = Path(__file__).resolve().parents[2]


def _launch(tmp_path, *extra):
    args = [sys.executable, str(ROOT / "launch" / "run.py"), "--quiet",
            "--config", str(Path(__file__).parent / "tiny_config.py"),
            f"--run_dir={tmp_path / 'runs'}", "--name=term",
            f"--data.sft.cache_dir={tmp_path / 'cache'}", *extra]
    env = dict(os.environ, JAXRL_CPU_DEVICES="2", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, cwd=tmp_path, start_new_session=True)


@pytest.mark.slow
def test_sigterm_stops_cleanly_and_the_run_resumes(tmp_path):
    steps = ["--pipeline.steps=6", "--train.checkpoint_every=2"]
    victim = _launch(tmp_path, *steps)
    metrics = tmp_path / "runs" / "term" / "metrics.jsonl"
    deadline = time.time() + 600
    while time.time() < deadline:  # after step 2 was logged (the checkpoint at 2 exists)
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        if victim.poll() is not None:
            pytest.fail("the run ended before the signal:\n" + victim.stdout.read()[-3000:])
        time.sleep(0.2)
    victim.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, _ = victim.communicate(timeout=120)
    assert victim.returncode == 143, out[-3000:]
    assert time.time() - t0 < 60
    assert "terminated (SIGTERM): stopped cleanly" in out and "--resume" in out
    time.sleep(1)
    left = subprocess.run(["pgrep", "-s", str(victim.pid)], capture_output=True, text=True)
    assert not left.stdout.strip(), f"processes of the run outlived it: {left.stdout}"
    resumed = _launch(tmp_path, *steps, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert [r["step"] for r in read_metrics(tmp_path / "runs" / "term")] == list(range(6))
