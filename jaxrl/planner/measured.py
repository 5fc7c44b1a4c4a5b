"""Closing the loop: a run's measured rates in, the recommended split for that hardware out.

The controller writes `<run_dir>/metrics.jsonl`, one JSON object per step, with (names from
DESIGN.md) `pipeline/rollouts_per_s_produced`, `pipeline/rollouts_per_s_consumed`,
`pipeline/trainer_idle_frac`, `pipeline/generator_idle_frac`, `pipeline/weight_sync_s`,
`train/mfu`, `sandbox/exec_s_p50`, `sandbox/queue_wait_s_p50`, and — so the planner knows the
split it measured — `pipeline/trainer_chips`, `pipeline/generator_chips`, `pipeline/batch_size`
and `pipeline/mode`. Only the first two and the chip counts are required.

Model: each side's *capacity* (samples/s while busy) is its measured rate / (1 - its idle
fraction), where idle includes weight-sync pauses; capacities scale linearly with chips
(per-chip rates held fixed), and `analytic.pipeline_rates` combines them per mode with the
measured weight-sync time. Without a batch size only the run's own mode is compared.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.planner.analytic import MODES, ModeRates, check_mode, pipeline_rates
from jaxrl.planner.recommend import Recommendation, recommend

PRODUCED = "pipeline/rollouts_per_s_produced"
CONSUMED = "pipeline/rollouts_per_s_consumed"
TRAINER_IDLE = "pipeline/trainer_idle_frac"
GENERATOR_IDLE = "pipeline/generator_idle_frac"
SYNC = "pipeline/weight_sync_s"
MFU = "train/mfu"
SANDBOX_EXEC = "sandbox/exec_s_p50"
SANDBOX_WAIT = "sandbox/queue_wait_s_p50"
TRAINER_CHIPS = "pipeline/trainer_chips"
GENERATOR_CHIPS = "pipeline/generator_chips"
BATCH = "pipeline/batch_size"
MODE = "pipeline/mode"


@dataclasses.dataclass(frozen=True)
class MeasuredRates:
    """Measured (or published) rates of one run at one split."""

    trainer_chips: int
    generator_chips: int
    produced_per_s: float
    consumed_per_s: float
    trainer_idle_frac: float | None = None
    generator_idle_frac: float | None = None
    weight_sync_s: float = 0.0
    batch_size: int | None = None
    train_mfu: float | None = None
    sandbox_exec_s: float | None = None
    mode: str = "async"

    def __post_init__(self):
        check_mode(self.mode)
        if self.trainer_chips < 1 or self.generator_chips < 1:
            raise ValueError(f"chip counts must be >= 1, got trainer={self.trainer_chips} "
                             f"generator={self.generator_chips}")
        if not (self.produced_per_s > 0 and self.consumed_per_s > 0):
            raise ValueError(f"rates must be > 0, got produced={self.produced_per_s} "
                             f"consumed={self.consumed_per_s}")
        for name in ("trainer_idle_frac", "generator_idle_frac"):
            v = getattr(self, name)
            if v is not None and not 0 <= v < 1:
                raise ValueError(f"{name} must be in [0, 1), got {v}")

    @property
    def trainer_capacity(self) -> float:
        return self.consumed_per_s / (1 - (self.trainer_idle_frac or 0.0))

    @property
    def generator_capacity(self) -> float:
        return self.produced_per_s / (1 - (self.generator_idle_frac or 0.0))

    @property
    def busy_mfu(self) -> float | None:
        if self.train_mfu is None:
            return None
        return self.train_mfu / (1 - (self.trainer_idle_frac or 0.0))

    def evaluate(self, trainer_chips: int, generator_chips: int) -> dict[str, ModeRates]:
        t = self.trainer_capacity * trainer_chips / self.trainer_chips
        g = self.generator_capacity * generator_chips / self.generator_chips
        if self.batch_size is None:  # rates only: the overlap limit min(t, g), no sync term
            return {m: pipeline_rates(m, 1, t, g) for m in MODES}
        return {m: pipeline_rates(m, self.batch_size, t, g, sync_s=self.weight_sync_s)
                for m in MODES}


def _number(rates: Mapping[str, Any], key: str) -> float | None:
    v = rates.get(key)
    if v is None:
        return None
    try:
        v = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"metric {key!r} must be a number, got {v!r}") from None
    return v if math.isfinite(v) else None


def measured_rates(rates: Mapping[str, Any], *, trainer_chips: int | None = None,
                   generator_chips: int | None = None, batch_size: int | None = None,
                   mode: str | None = None) -> MeasuredRates:
    """Builds `MeasuredRates` from metric names; keyword arguments override the metrics."""
    trainer_chips = trainer_chips or _number(rates, TRAINER_CHIPS)
    generator_chips = generator_chips or _number(rates, GENERATOR_CHIPS)
    produced, consumed = _number(rates, PRODUCED), _number(rates, CONSUMED)
    missing = [k for k, v in ((PRODUCED, produced), (CONSUMED, consumed),
                              (TRAINER_CHIPS, trainer_chips), (GENERATOR_CHIPS, generator_chips))
               if v is None]
    if missing:
        raise ValueError(f"measured rates lack {missing} (pass chip counts as arguments if the "
                         f"run did not record them); got keys {sorted(rates)}")
    batch = batch_size or _number(rates, BATCH)
    return MeasuredRates(
        trainer_chips=int(trainer_chips), generator_chips=int(generator_chips),
        produced_per_s=produced, consumed_per_s=consumed,
        trainer_idle_frac=_number(rates, TRAINER_IDLE),
        generator_idle_frac=_number(rates, GENERATOR_IDLE),
        weight_sync_s=_number(rates, SYNC) or 0.0,
        batch_size=int(batch) if batch else None, train_mfu=_number(rates, MFU),
        sandbox_exec_s=_number(rates, SANDBOX_EXEC),
        mode=mode or str(rates.get(MODE) or "async"))


def from_measured(rates: Mapping[str, Any] | MeasuredRates, *, total_chips: int | None = None,
                  granularity: int = 1, modes: Sequence[str] | None = None,
                  sandbox_utilization: float = 0.8, **overrides: Any) -> Recommendation:
    """The split (and mode) of `total_chips` (default: the run's) that maximises consumed
    samples/s, given one run's measured metrics; `gain` is relative to the measured run.

    `overrides` (trainer_chips, generator_chips, batch_size, mode) replace metric values.
    """
    m = rates if isinstance(rates, MeasuredRates) else measured_rates(rates, **overrides)
    total = total_chips or m.trainer_chips + m.generator_chips
    if modes is None:
        modes = MODES if m.batch_size is not None else (m.mode,)
    busy = m.busy_mfu
    rec = recommend(total, m.evaluate, granularity=granularity, modes=modes,
                    baseline=(m.trainer_chips, m.generator_chips, m.mode),
                    mfu_of=(lambda t, g, r: busy * (1 - r.trainer_idle)) if busy else None)
    notes = [f"measured: trainer capacity {m.trainer_capacity:.4g} samples/s on "
             f"{m.trainer_chips} chips, generator capacity {m.generator_capacity:.4g} samples/s "
             f"on {m.generator_chips} chips, mode {m.mode}"]
    if m.sandbox_exec_s:
        cores = rec.best.rates.consumed_per_s * m.sandbox_exec_s / sandbox_utilization
        notes.append(f"sandbox: {math.ceil(cores)} CPU cores keep up with the recommended split "
                     f"({m.sandbox_exec_s:.3g} s per sample at {sandbox_utilization:.0%} busy)")
    if m.batch_size is None:
        notes.append(f"no {BATCH} recorded: only mode {m.mode!r} compared")
    return dataclasses.replace(rec, notes=tuple(notes))


def read_run(run_dir: str | os.PathLike[str], *, warmup: int | None = None) -> dict[str, Any]:
    """Median of each numeric metric over `<run_dir>/metrics.jsonl` after `warmup` steps
    (default: a tenth of the steps); non-numeric values (e.g. the mode) keep their last value."""
    path = os.path.join(os.fspath(run_dir), "metrics.jsonl")
    if not os.path.exists(path):
        raise FileNotFoundError(f"no metrics.jsonl in {os.fspath(run_dir)!r} (looked for {path})")
    with open(path) as f:
        rows = [json.loads(line) for line in f if line.strip()]
    if not rows:
        raise ValueError(f"{path} has no rows")
    skip = len(rows) // 10 if warmup is None else warmup
    rows = rows[skip:] or rows[-1:]
    out: dict[str, Any] = {}
    for key in {k for row in rows for k in row}:
        values = [row[key] for row in rows if key in row]
        nums = sorted(float(v) for v in values
                      if isinstance(v, (int, float)) and not isinstance(v, bool)
                      and math.isfinite(v))
        out[key] = nums[len(nums) // 2] if len(nums) == len(values) and nums else values[-1]
    return out
