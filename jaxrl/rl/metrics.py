"""Run metrics: `metrics.jsonl` (one object per step), TensorBoard, the RL progress display, a
summary; sample completions (`samples.jsonl` + TensorBoard text) and the run config (TensorBoard
text).

Metric names are stable (docs/metrics.md defines each). Only process 0 writes (`enabled=False`
elsewhere). Each row is one unbuffered append of the whole line, so a crash or Ctrl-C loses
nothing already logged; a write that fails (ENOSPC or any OSError) cuts the file back to its
last complete line before the error goes on. On resume the logs are rewound to the checkpoint
(`rewind_logs`: rows and samples of later steps dropped, TensorBoard's events rewritten without
them and the new event file purging them for a TensorBoard already reading) and steps continue
from there; a rerun without a checkpoint first moves the old logs aside (`set_aside_logs`). The
progress display names each step by the number metrics.jsonl gives it (0-based) and counts steps
done beside it.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import logging
import math
import os
import struct
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

from jaxrl.config import ConfigError, RunConfig, to_dict
from jaxrl.planner.cli import format_recommendation
from jaxrl.planner.measured import from_measured, read_run
from jaxrl.progress import Progress

log = logging.getLogger("jaxrl")

# The gap metrics every run reports (DESIGN.md). Others (loss/*, is/*, eval/*) come on top.
REQUIRED = (
    "pipeline/rollouts_per_s_produced",
    "pipeline/rollouts_per_s_consumed",
    "pipeline/trainer_idle_frac",
    "pipeline/generator_idle_frac",
    "pipeline/weight_sync_s",
    "pipeline/weight_sync_gbps",
    "train/mfu",
    "train/tokens_per_s",
    "gen/tokens_per_s",
    "staleness/mean",
    "staleness/max",
    "sandbox/queue_wait_s_p50",
    "sandbox/exec_s_p50",
    "sandbox/timeouts",
    "reward/mean",
    "reward/zero_variance_group_frac",
)

_SUMMARY_KEYS = (
    ("reward/mean", "reward"),
    ("eval/pass@1", "pass@1"),
    ("pipeline/trainer_idle_frac", "trainer idle"),
    ("pipeline/generator_idle_frac", "gen idle"),
    ("pipeline/rollouts_per_s_produced", "produced/s"),
    ("pipeline/rollouts_per_s_consumed", "consumed/s"),
    ("pipeline/weight_sync_gbps", "sync GB/s"),
    ("train/mfu", "MFU"),
    ("staleness/max", "staleness max"),
)


def _plain(value: Any) -> Any:
    if isinstance(value, (np.generic, np.ndarray)):
        value = value.item() if np.ndim(value) == 0 else np.asarray(value).tolist()
    if hasattr(value, "item") and getattr(value, "ndim", 1) == 0:  # jax scalars
        value = value.item()
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsLogger:
    def __init__(self, run_dir: str | Path, *, total_steps: int, enabled: bool = True,
                 tensorboard: bool = True, progress: bool = True, stream=None,
                 samples_every: int = 1):
        self.run_dir = Path(run_dir)
        self.samples_every = samples_every
        self.total_steps = total_steps
        self.enabled = enabled
        self.progress = progress and enabled
        self.stream = stream or sys.stderr
        self.history: list[dict[str, Any]] = []
        self._bar: Progress | None = None
        self._tb = None
        self._file = None
        self._samples = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / "metrics.jsonl", "ab", buffering=0)
            if tensorboard:
                from tensorboardX import SummaryWriter

                # resumed: TensorBoard drops any events it read past the rewound rows
                logged = read_metrics(self.run_dir)
                self._tb = SummaryWriter(str(self.run_dir / "tb"),
                                         purge_step=logged[-1]["step"] + 1 if logged else None)

    def log_step(self, step: int, metrics: dict[str, Any], samples: list[dict]) -> None:
        """A step's row and its batch's samples: every `samples_every` steps, or, in a run
        shorter than that, at its last step."""
        self.log(step, metrics)
        short = 0 < self.total_steps < self.samples_every and step + 1 == self.total_steps
        self.log_samples(step, samples, every=1 if short else self.samples_every)

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": int(step), "time": time.time()}
        row.update({k: _plain(v) for k, v in sorted(metrics.items())})
        self.history.append(row)
        if not self.enabled:
            return row
        append_whole(self._file, json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)):
                    self._tb.add_scalar(k.replace("@", "_at_"), v, step)
            self._tb.flush()
        if self.progress:
            self._progress(step, row)
        return row

    def _progress(self, step: int, row: dict[str, Any]) -> None:
        if self._bar is None:  # a resumed run starts its count at the checkpoint
            self._bar = Progress("RL", self.total_steps, initial=step, stream=self.stream)
        fields = {"step": step}
        for key, label in (("reward/mean", "reward"), ("loss/total", "loss"),
                           ("eval/pass@1", "pass@1"),
                           ("pipeline/rollouts_per_s_produced", "prod/s"),
                           ("pipeline/rollouts_per_s_consumed", "cons/s"),
                           ("pipeline/trainer_idle_frac", "idle T"),
                           ("pipeline/generator_idle_frac", "idle G"),
                           ("staleness/max", "stale")):
            if isinstance(row.get(key), (int, float)):
                fields[label] = round(float(row[key]), 4)
        self._bar.update(step + 1 - self._bar.done, **fields)

    def log_config(self, config: dict[str, Any]) -> None:
        """The run config as TensorBoard text (tag `config`)."""
        if self._tb is not None:
            text = json.dumps(config, indent=2, default=str)
            self._tb.add_text("config", "```\n" + text + "\n```", 0)
            self._tb.flush()

    def log_samples(self, step: int, samples: list[dict[str, Any]], *, every: int = 1) -> None:
        """(prompt, completion, reward) samples of a step: `samples.jsonl` and TensorBoard text;
        only for steps s with (s + 1) % every == 0 (`every=0`: never)."""
        if not self.enabled or not samples or every <= 0 or (step + 1) % every:
            return
        if self._samples is None:
            self._samples = open(self.run_dir / "samples.jsonl", "ab", buffering=0)
        append_whole(self._samples, "".join(
            json.dumps({"step": int(step), **{k: _plain(v) for k, v in s.items()}}) + "\n"
            for s in samples))
        if self._tb is not None:
            parts = []
            for i, s in enumerate(samples):
                parts.append(f"**sample {i}** (reward {float(s['reward']):.3g})\n\n"
                             f"```\n{s['prompt']}\n```\n\n```\n{s['completion']}\n```")
            self._tb.add_text("samples", "\n\n---\n\n".join(parts), step)
            self._tb.flush()

    def summary(self) -> str:
        """An end-of-run table: first, last and mean of the headline metrics."""
        rows = []
        for key, label in _SUMMARY_KEYS:
            values = [h[key] for h in self.history if isinstance(h.get(key), (int, float))]
            if values:
                rows.append((label, values[0], values[-1], float(np.mean(values))))
        if not self.history:  # nothing ran here: say what the run directory holds
            logged = read_metrics(self.run_dir)
            if logged and logged[-1]["step"] >= self.total_steps - 1:
                return (f"run {self.run_dir.name} is complete at step {logged[-1]['step']} "
                        f"({self.total_steps} steps); nothing to do")
            if logged:
                return f"nothing ran; {self.run_dir.name} has steps up to {logged[-1]['step']}"
            return "no metrics were logged"
        if not rows:
            return "no metrics were logged"
        width = max(len(r[0]) for r in rows)
        out = [f"{'metric':<{width}}  {'first':>10}  {'last':>10}  {'mean':>10}"]
        out += [f"{label:<{width}}  {a:>10.4g}  {b:>10.4g}  {m:>10.4g}" for label, a, b, m in rows]
        return "\n".join(out)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.close()
            self._bar = None
        if self._samples is not None:
            self._samples.close()
            self._samples = None
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


def append_whole(file, text: str) -> None:
    """Append `text` (whole lines) to `file` (opened "ab", unbuffered) in one write; when the
    write fails or is cut short, truncate back to where it started and raise, so no torn line
    is left behind (a full disk stops the run with the rows before it intact)."""
    data = text.encode()
    fd = file.fileno()
    start = os.fstat(fd).st_size
    try:
        done = os.write(fd, data)
        while done < len(data):  # a short write: the rest, or the error that cut it short
            written = os.write(fd, data[done:])
            if written == 0:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            done += written
    except OSError as e:
        try:
            os.ftruncate(fd, start)
        except OSError:
            pass
        raise OSError(e.errno, f"could not append to {file.name} ({e.strerror or e}); it "
                               f"ends at its last complete line") from e


# What a run directory logs; a rerun without a checkpoint moves them aside (`set_aside_logs`).
LOG_NAMES = ("metrics.jsonl", "samples.jsonl", "trace.json", "tb", "config.json", "checkpoints")


def set_aside_logs(run_dir: str | Path) -> Path | None:
    """Move the logs of an earlier attempt (a run directory without a committed checkpoint) into
    `run_dir/previous-<date>-<time>/` so the new run starts fresh logs; returns that folder."""
    run_dir = Path(run_dir)
    present = [run_dir / name for name in LOG_NAMES if (run_dir / name).exists()]
    if not present:
        return None
    aside = run_dir / time.strftime("previous-%Y%m%d-%H%M%S")
    n = 1
    while aside.exists():
        n += 1
        aside = run_dir / time.strftime(f"previous-%Y%m%d-%H%M%S-{n}")
    aside.mkdir()
    for path in present:
        path.rename(aside / path.name)
    return aside


def read_metrics(run_dir: str | Path) -> list[dict[str, Any]]:
    """Rows of `<run_dir>/metrics.jsonl` (a torn last line from a crash is ignored)."""
    rows = []
    path = Path(run_dir) / "metrics.jsonl"
    if not path.exists():
        return rows
    for line in path.read_text().splitlines():
        try:
            rows.append(json.loads(line))
        except json.JSONDecodeError:
            continue
    return rows


def prepare_run_dir(cfg: RunConfig, resume: bool, *, leader: bool) -> Path:
    """The run directory: new (config.json written), or one with checkpoints for `--resume`. A
    directory without a committed checkpoint is started afresh, its old logs moved aside."""
    run_dir = cfg.path
    if not leader:
        return run_dir
    ckpt = run_dir / "checkpoints"
    has_ckpt = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
    if has_ckpt and not resume and cfg.name == DEFAULT_NAME and not _multi_process():
        run_dir = _fresh_name(run_dir)
        log.warning("%s already has checkpoints (an earlier run); this run is %s. To continue "
                    "the earlier one instead: --name=%s --resume (resume=True from Python)",
                    cfg.path, run_dir, cfg.name)
        cfg = dataclasses.replace(cfg, name=run_dir.name)
    elif has_ckpt and not resume:
        raise ConfigError(
            f"run directory {run_dir} already has checkpoints; continue it with --resume "
            f"(resume=True from Python), or choose another name (--name) for a new run")
    if resume and not has_ckpt:
        raise ConfigError(f"resume: no checkpoint under {ckpt} to continue from; start the run "
                          "without --resume (resume=False from Python)")
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as e:  # jaxrl.api.train with a run_dir it cannot write (the CLI checks first)
        raise ConfigError(f"run_dir={cfg.run_dir!r}: cannot create {run_dir}: "
                          f"{e.strerror or e}; choose another run_dir") from None
    if not resume:
        aside = set_aside_logs(run_dir)  # an earlier attempt stopped before its first checkpoint
        if aside is not None:
            log.warning("%s had logs but no checkpoint: moved them to %s; starting fresh",
                        run_dir, aside)
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1, default=str))
    return run_dir


DEFAULT_NAME = RunConfig.__dataclass_fields__["name"].default  # "default": the README's run


def _multi_process() -> bool:
    import jax  # started by now (the run's meshes exist)

    return jax.process_count() > 1


def _fresh_name(run_dir: Path) -> Path:
    """`run_dir` with the first suffix -2, -3, ... that names no directory yet."""
    n = 2
    while run_dir.with_name(f"{run_dir.name}-{n}").exists():
        n += 1
    return run_dir.with_name(f"{run_dir.name}-{n}")


def rewind_logs(run_dir: Path, from_step: int) -> None:
    """On resume from the checkpoint after `from_step` steps: drop what was logged for steps
    `from_step` on (they run again), so each step is logged once: rows of metrics.jsonl,
    samples.jsonl and TensorBoard's events."""
    for name in ("metrics.jsonl", "samples.jsonl"):
        _rewind_jsonl(run_dir / name, from_step)
    rewind_tensorboard(run_dir / "tb", from_step)


def _rewind_jsonl(path: Path, from_step: int) -> None:
    if not path.exists():
        return
    kept = []
    for line in path.read_text().splitlines():
        try:
            row = json.loads(line)
        except json.JSONDecodeError:  # a torn last line from a crash
            continue
        if row.get("step", 0) < from_step:
            kept.append(json.dumps(row) + "\n")
    tmp = path.with_suffix(".tmp")
    tmp.write_text("".join(kept))
    tmp.replace(path)


def tfrecords(data: bytes) -> list[bytes]:
    """The records of a TFRecord file (TensorBoard's event files), a torn last one left out:
    each is its length (u64), the length's masked CRC (u32), the bytes, their masked CRC."""
    out, i = [], 0
    while i + 12 <= len(data):
        (n,) = struct.unpack("<Q", data[i:i + 8])
        if i + 16 + n > len(data):
            break
        out.append(data[i + 12:i + 12 + n])
        i += 16 + n
    return out


def rewind_tensorboard(tb_dir: Path, from_step: int) -> None:
    """Rewrite each event file under `tb_dir` without events of steps `from_step` on, and
    without the config text (the resumed run logs its own): TensorBoard event files are
    append-only records, so the kept ones are written to a new file that replaces the old."""
    if not tb_dir.is_dir():
        return
    from tensorboardX.proto.event_pb2 import Event
    from tensorboardX.record_writer import masked_crc32c

    for path in sorted(tb_dir.glob("events.out.tfevents.*")):
        data = path.read_bytes()
        records = tfrecords(data)
        kept = []
        for record in records:
            event = Event.FromString(record)
            is_config = event.HasField("summary") and any(
                v.tag.startswith("config") for v in event.summary.value)
            if event.step < from_step and not is_config:
                kept.append(record)
        if len(kept) == len(records) and sum(16 + len(r) for r in records) == len(data):
            continue  # nothing to drop
        out = bytearray()
        for record in kept:
            header = struct.pack("<Q", len(record))
            out += header + struct.pack("<I", masked_crc32c(header))
            out += record + struct.pack("<I", masked_crc32c(record))
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_bytes(bytes(out))
        tmp.replace(path)


def planner_report(run_dir: Path) -> str | None:
    """The planner's recommended split from this run's measured rates (advice; never fails)."""
    try:
        rec = from_measured(read_run(run_dir))
        return ("planner, from this run's measured rates "
                f"(python launch/plan.py --from-run {run_dir}):\n" + format_recommendation(rec))
    except Exception as e:  # noqa: BLE001 - advice only; never fail a finished run
        log.debug("planner feedback unavailable: %s", e)
        return None


def report(cfg: RunConfig, result, wall_s: float, advice: str | None) -> None:
    """The run's last lines: steps and wall-clock, the summary, pass@1 before -> after, advice."""
    lines = [f"run {cfg.name}: {result.steps_done} steps in {wall_s:.0f}s "
             f"({cfg.pipeline.mode} mode) -> {result.run_dir}", result.summary]
    if result.eval_start or result.eval_end:
        a = result.eval_start.get("eval/pass@1", float("nan"))
        b = result.eval_end.get("eval/pass@1", float("nan"))
        lines.append(f"held-out pass@1: {a:.3f} before RL -> {b:.3f} after")
    if advice:
        lines.append(advice)
    print("\n".join(lines), flush=True)


def fmt_metrics(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items())
                     if isinstance(v, float) and np.isfinite(v))
