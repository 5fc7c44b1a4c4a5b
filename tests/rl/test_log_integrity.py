"""The logs of a run directory stay consistent with its checkpoints: a rerun without --resume of
a run that stopped before its first checkpoint starts fresh logs, the old ones moved aside (it
used to append: steps [0, 0, 1, 2, ...]); a row is written whole or not at all (a full disk
used to leave a torn last line); a resume rewinds metrics.jsonl, samples.jsonl and TensorBoard
to the checkpoint (samples and TensorBoard used to keep steps 6-8 twice, issue 47); the README's
command run twice starts a second run beside the first."""

import errno
import json
import logging
import os
import struct
import time

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


def test_a_named_run_with_a_checkpoint_still_needs_resume(tmp_path):
    cfg = tiny_run_config(tmp_path)
    (cfg.path / "checkpoints" / "2").mkdir(parents=True)
    (cfg.path / "metrics.jsonl").write_text('{"step": 0}\n')
    with pytest.raises(ConfigError, match=r"continue it with --resume \(resume=True from "
                                          r"Python\), or choose another name"):
        metrics.prepare_run_dir(cfg, False, leader=True)
    assert (cfg.path / "metrics.jsonl").exists()


def test_the_default_run_started_again_is_a_new_run_beside_it(tmp_path, caplog):
    """`python launch/run.py` twice: the second run is runs/default-2, said in one line; the
    first is untouched (it used to stop with "already has checkpoints; pass --resume")."""
    cfg = tiny_run_config(tmp_path, name="default")
    (cfg.path / "checkpoints" / "2").mkdir(parents=True)
    (cfg.path / "metrics.jsonl").write_text('{"step": 0}\n')
    (tmp_path / "runs" / "default-2").mkdir()  # taken: the next free suffix is used
    with caplog.at_level(logging.WARNING, logger="jaxrl"):
        run_dir = metrics.prepare_run_dir(cfg, False, leader=True)
    assert run_dir == tmp_path / "runs" / "default-3"
    assert json.loads((run_dir / "config.json").read_text())["name"] == "default-3"
    assert (cfg.path / "metrics.jsonl").read_text() == '{"step": 0}\n'
    assert not (cfg.path / "config.json").exists()
    assert "this run is" in caplog.text and "--name=default --resume" in caplog.text
    with pytest.raises(ConfigError, match="no checkpoint under .* start the run without "
                                          "--resume"):
        metrics.prepare_run_dir(tiny_run_config(tmp_path, name="none"), True, leader=True)


def _events(path):
    """Each (step, tag, value) of a TensorBoard event file, read with the TFRecord framing
    checked (length, CRCs) as TensorBoard's reader does."""
    from tensorboardX.crc32c import crc32c
    from tensorboardX.proto.event_pb2 import Event

    def masked(data):
        crc = crc32c(data)
        return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF

    data, i, out = path.read_bytes(), 0, []
    while i < len(data):
        header = data[i:i + 8]
        (n,) = struct.unpack("<Q", header)
        assert struct.unpack("<I", data[i + 8:i + 12])[0] == masked(header)
        record = data[i + 12:i + 12 + n]
        assert struct.unpack("<I", data[i + 12 + n:i + 16 + n])[0] == masked(record)
        event = Event.FromString(record)
        if event.HasField("session_log"):
            out.append((event.step, "session_log", event.session_log.status))
        for v in event.summary.value:
            out.append((event.step, v.tag, v.simple_value if v.HasField("simple_value")
                        else None))
        i += 16 + n
    return out


def _tensorboard_view(tb_dir):
    """Steps of `reward/mean` as TensorBoard shows them: files in name order, a SessionLog
    START at step s dropping what was read at s and after (its purge of orphaned data)."""
    from tensorboardX.proto.event_pb2 import SessionLog

    seen = []
    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        for step, tag, value in _events(path):
            if tag == "session_log" and value == SessionLog.START:
                seen = [(s, v) for s, v in seen if s < step]
            elif tag == "reward/mean":
                seen.append((step, value))
    return seen


def test_resume_rewinds_samples_and_tensorboard_like_metrics(tmp_path):
    """SIGKILL during the checkpoint after 9 steps, resumed from the one after 6: steps 6-8 are
    logged again, and each step shows once in every log."""
    first = MetricsLogger(tmp_path, total_steps=12, progress=False)
    first.log_config({"lr": 1})
    for step in range(9):
        first.log_step(step, {"reward/mean": 0.5}, [{"prompt": "p", "completion": str(step),
                                                     "reward": 0.5}])
    first.close()  # SIGKILL: nothing more; the tail of the last event file torn as well
    (old,) = (tmp_path / "tb").glob("events.out.tfevents.*")
    old.write_bytes(old.read_bytes() + b"\x10\x00\x00")
    metrics.rewind_logs(tmp_path, 6)
    assert sorted({s for s, _, _ in _events(old) if s > 0}) == [1, 2, 3, 4, 5]
    assert not [t for _, t, _ in _events(old) if t.startswith("config")]  # logged again
    time.sleep(1.1)  # the resumed run's event file sorts after the first (named by the second)
    again = MetricsLogger(tmp_path, total_steps=12, progress=False)
    again.log_config({"lr": 1})
    for step in range(6, 12):
        again.log_step(step, {"reward/mean": 0.25}, [{"prompt": "p", "completion": str(step),
                                                      "reward": 0.25}])
    again.close()
    want = [(s, 0.5) for s in range(6)] + [(s, 0.25) for s in range(6, 12)]
    assert [(r["step"], r["reward/mean"]) for r in read_metrics(tmp_path)] == want
    samples = [json.loads(line) for line in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [(s["step"], s["completion"]) for s in samples] == [(s, str(s)) for s in range(12)]
    assert _tensorboard_view(tmp_path / "tb") == want
    every_file = [(s, v) for p in sorted((tmp_path / "tb").glob("events.out.tfevents.*"))
                  for s, t, v in _events(p) if t == "reward/mean"]
    assert every_file == want  # also without TensorBoard's purge (other readers)
    configs = [p for p in (tmp_path / "tb").glob("*") for _, t, _ in _events(p)
               if t.startswith("config")]
    assert len(configs) == 1


@pytest.mark.parametrize("every, steps", [(10, [2]), (2, [1]), (1, [0, 1, 2])])
def test_a_run_shorter_than_samples_every_writes_its_last_step_samples(tmp_path, every, steps):
    logger = MetricsLogger(tmp_path, total_steps=3, tensorboard=False, progress=False,
                           samples_every=every)
    for step in range(3):
        logger.log_step(step, {"reward/mean": 0.5}, [{"prompt": "p", "completion": "c",
                                                      "reward": 0.5}])
    logger.close()
    lines = (tmp_path / "samples.jsonl").read_text().splitlines()
    assert [json.loads(line)["step"] for line in lines] == steps


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
