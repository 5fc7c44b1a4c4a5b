"""The logs of a run directory stay consistent with its checkpoints: a rerun without --resume of
a run that stopped before its first checkpoint starts fresh logs, the old ones moved aside (it
used to append: steps [0, 0, 1, 2, ...]); a row is written whole or not at all (a full disk
used to leave a torn last line)."""

import errno
import json
import os

import pytest
from run_helpers import tiny_run_config

from jaxrl.config import ConfigError
from jaxrl.rl import metrics
from jaxrl.rl.metrics import MetricsLogger, read_metrics


def _logger(run_dir):
    return MetricsLogger(run_dir, total_steps=10, tensorboard=False, progress=False)


def test_a_rerun_without_a_checkpoint_moves_the_old_logs_aside(tmp_path):
    cfg = tiny_run_config(tmp_path)
    run_dir = cfg.path
    (run_dir / "tb").mkdir(parents=True)
    (run_dir / "tb" / "events.out.tfevents.1.host").write_bytes(b"old events")
    (run_dir / "trace.json").write_text('{"traceEvents": []}')
    (run_dir / "checkpoints" / "2.orbax-checkpoint-tmp").mkdir(parents=True)  # never committed
    first = _logger(run_dir)
    for step in (0, 1):
        first.log(step, {"reward/mean": 0.5})
    first.close()
    old = (run_dir / "metrics.jsonl").read_text()
    assert metrics.prepare_run_dir(cfg, False, leader=True) == run_dir
    (aside,) = [p for p in run_dir.iterdir() if p.name.startswith("previous-")]
    assert (aside / "metrics.jsonl").read_text() == old  # moved, not deleted
    assert (aside / "tb" / "events.out.tfevents.1.host").read_bytes() == b"old events"
    assert (aside / "trace.json").exists() and (aside / "checkpoints").is_dir()
    assert sorted(p.name for p in run_dir.iterdir()) == ["config.json", aside.name]
    again = _logger(run_dir)
    for step in (0, 1, 2):
        again.log(step, {"reward/mean": 0.25})
    again.close()
    assert [r["step"] for r in read_metrics(run_dir)] == [0, 1, 2]


def test_a_committed_checkpoint_still_needs_resume(tmp_path):
    cfg = tiny_run_config(tmp_path)
    (cfg.path / "checkpoints" / "2").mkdir(parents=True)
    (cfg.path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match="pass --resume"):
        metrics.prepare_run_dir(cfg, False, leader=True)
    assert (cfg.path / "metrics.jsonl").exists()


@pytest.mark.parametrize("how", ["error mid-write", "short write, then full"])
def test_a_failed_write_leaves_no_torn_row(tmp_path, monkeypatch, how):
    logger = _logger(tmp_path)
    for step in (0, 1):
        logger.log(step, {"reward/mean": 0.5, "text": "x" * 5000})
    whole = (tmp_path / "metrics.jsonl").read_bytes()
    real_write, calls = os.write, []

    def disk_fills(fd, data):
        calls.append(len(data))
        if how == "short write, then full" and len(calls) == 1:
            return real_write(fd, data[: len(data) // 2])
        real_write(fd, data[: len(data) // 3])  # what reached the disk before it filled
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    monkeypatch.setattr(metrics.os, "write", disk_fills)
    with pytest.raises(OSError, match=r"could not append to .*metrics.jsonl \(No space left on "
                                      r"device\); it ends at its last complete line"):
        logger.log(2, {"reward/mean": 0.5, "text": "y" * 5000})
    monkeypatch.undo()
    assert (tmp_path / "metrics.jsonl").read_bytes() == whole
    logger.log(2, {"reward/mean": 0.5})  # space again: the row is written whole
    logger.close()
    lines = (tmp_path / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == [0, 1, 2]
