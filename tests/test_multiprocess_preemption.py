"""SIGTERM to one process of a two-process run stops both after the same step, with one
checkpoint both resume from (the processes agree at the end of each step; it used to stop only
the signalled one, and the other failed on its next collective)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
TIMEOUT_S = 420

# tests/multiprocess_config.py with its reward slowed (same values), so a signal lands mid-run
CONFIG = """
import sys, time
sys.path.insert(0, {tests!r})
import multiprocess_config as base
from jaxrl.rewards.rewards import register_reward

dense = base.mp_test_dense


@register_reward("mp_test_dense", isolated=False, overwrite=True)
def slow_dense(prompt, completion, **fields):
    time.sleep(0.02)
    return dense(prompt, completion, **fields)


config = base.config
"""


def _cluster(tmp_path, *extra):
    config = tmp_path / "slow_mp_config.py"
    config.write_text(CONFIG.format(tests=str(Path(__file__).parent)))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONUNBUFFERED="1",
               XLA_FLAGS="--xla_force_host_platform_device_count=1", JAXRL_CPU_DEVICES="1")
    cmd = [sys.executable, str(ROOT / "launch" / "local_cluster.py"), "-n", "2", "--grace-s",
           "60", "--", "--quiet", "--config", str(config), f"--run_dir={tmp_path / 'runs'}",
           "--name=pre", f"--data.sft.cache_dir={tmp_path / 'cache'}", "--pipeline.steps=10",
           "--train.checkpoint_every=20", *extra]
    return subprocess.Popen(cmd, env=env, cwd=tmp_path, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)


def _kill(proc):
    if proc is not None and proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


@pytest.mark.slow
def test_sigterm_to_one_process_stops_both_at_the_same_step(tmp_path):
    cluster = None
    lines: list[str] = []
    try:
        cluster = _cluster(tmp_path)
        reader = threading.Thread(target=lambda: lines.extend(iter(cluster.stdout.readline, "")),
                                  daemon=True)
        reader.start()
        metrics = tmp_path / "runs" / "pre" / "metrics.jsonl"
        deadline = time.time() + TIMEOUT_S
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
            assert cluster.poll() is None, "".join(lines)[-3000:]
            assert time.time() < deadline, "the run did not start:\n" + "".join(lines)[-3000:]
            time.sleep(0.1)
        pids = [int(line.split("pid ")[1].rstrip(")\n")) for line in lines
                if line.startswith("[local_cluster] process") and "started" in line]
        os.kill(pids[1], signal.SIGTERM)
        cluster.wait(timeout=120)
        reader.join(10)
    finally:
        _kill(cluster)
    out = "".join(lines)
    codes = re.search(r"exit codes \{0: (-?\d+), 1: (-?\d+)\}", out)
    assert codes and codes.groups() == ("143", "143"), out[-3000:]
    steps = {int(m.group(2)) for m in re.finditer(
        r"\[(\d)\] terminated \(SIGTERM\): stopped cleanly, checkpoint at step (\d+)", out)}
    said = re.findall(r"\[(\d)\] terminated \(SIGTERM\): stopped cleanly, checkpoint", out)
    assert sorted(said) == ["0", "1"] and len(steps) == 1, out[-3000:]
    (step,) = steps
    run_dir = tmp_path / "runs" / "pre"
    assert 2 <= step < 10
    assert (run_dir / "checkpoints" / str(step) / "jaxrl_integrity.json").is_file()
    resumed = _cluster(tmp_path, "--resume")
    try:
        out, _ = resumed.communicate(timeout=TIMEOUT_S)
    finally:
        _kill(resumed)
    assert resumed.returncode == 0, out[-3000:]
    rows = (run_dir / "metrics.jsonl").read_text().splitlines()
    assert [int(re.search(r'"step": (\d+)', r).group(1)) for r in rows] == list(range(10))
