"""Run metrics: `metrics.jsonl` (one object per step), TensorBoard, a live progress line, a summary.

Metric names are stable (docs/metrics.md defines each). Only process 0 writes (`enabled=False`
elsewhere). Lines are flushed every step, so a crash or Ctrl-C loses nothing already logged;
on resume the file is appended to and steps continue from the checkpoint.
"""

from __future__ import annotations

import json
import math
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np

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
                 tensorboard: bool = True, progress: bool = True, stream=None):
        self.run_dir = Path(run_dir)
        self.total_steps = total_steps
        self.enabled = enabled
        self.progress = progress and enabled
        self.stream = stream or sys.stderr
        self.history: list[dict[str, Any]] = []
        self._start = time.perf_counter()
        self._first_step: int | None = None
        self._tb = None
        self._file = None
        if enabled:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            self._file = open(self.run_dir / "metrics.jsonl", "a", buffering=1)
            if tensorboard:
                from tensorboardX import SummaryWriter

                self._tb = SummaryWriter(str(self.run_dir / "tb"))

    def log(self, step: int, metrics: dict[str, Any]) -> dict[str, Any]:
        row = {"step": int(step), "time": time.time()}
        row.update({k: _plain(v) for k, v in sorted(metrics.items())})
        self.history.append(row)
        if self._first_step is None:
            self._first_step = step
        if not self.enabled:
            return row
        self._file.write(json.dumps(row) + "\n")
        if self._tb is not None:
            for k, v in row.items():
                if k not in ("step", "time") and isinstance(v, (int, float)):
                    self._tb.add_scalar(k.replace("@", "_at_"), v, step)
            self._tb.flush()
        if self.progress:
            self._progress_line(step, row)
        return row

    def _progress_line(self, step: int, row: dict[str, Any]) -> None:
        done = step - (self._first_step or 0) + 1
        elapsed = time.perf_counter() - self._start
        eta = elapsed / max(done, 1) * max(self.total_steps - step - 1, 0)

        def f(key, fmt="{:.2f}"):
            v = row.get(key)
            return fmt.format(v) if isinstance(v, (int, float)) else "-"

        line = (
            f"step {step + 1}/{self.total_steps} | reward {f('reward/mean')} "
            f"| loss {f('loss/total', '{:.4f}')} "
            f"| prod {f('pipeline/rollouts_per_s_produced')}/s "
            f"cons {f('pipeline/rollouts_per_s_consumed')}/s "
            f"| idle T {f('pipeline/trainer_idle_frac')} G {f('pipeline/generator_idle_frac')} "
            f"| stale {f('staleness/max', '{:.0f}')} | ETA {eta:.0f}s"
        )
        print(line, file=self.stream, flush=True)

    def summary(self) -> str:
        """An end-of-run table: first, last and mean of the headline metrics."""
        rows = []
        for key, label in _SUMMARY_KEYS:
            values = [h[key] for h in self.history if isinstance(h.get(key), (int, float))]
            if values:
                rows.append((label, values[0], values[-1], float(np.mean(values))))
        if not rows:
            return "no metrics were logged"
        width = max(len(r[0]) for r in rows)
        out = [f"{'metric':<{width}}  {'first':>10}  {'last':>10}  {'mean':>10}"]
        out += [f"{label:<{width}}  {a:>10.4g}  {b:>10.4g}  {m:>10.4g}" for label, a, b, m in rows]
        return "\n".join(out)

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None
        if self._tb is not None:
            self._tb.close()
            self._tb = None


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
