"""Closing the loop: a run's measured rates in, the recommended split for that hardware out.

The controller (jaxrl/rl/loop.py) writes `<run_dir>/metrics.jsonl`, one JSON object
per step. The planner reads (names from DESIGN.md):

- `pipeline/rollouts_per_s_consumed`: rollouts per second of *trainer busy time* (the train
  step plus the weight publish it blocks on) - what the trainer could consume if never starved;
- `pipeline/rollouts_per_s_produced`: rollouts per second of *generator busy time*;
- `pipeline/trainer_idle_frac`, `pipeline/step_s`, `pipeline/weight_sync_s`, `train/mfu` (over
  the train step), `sandbox/exec_s_p50`: reported and compared with the prediction;
- the batch: `pipeline/batch_size`, else `pipeline/trainer_busy_s` * consumed/s;
- the split measured: `pipeline/trainer_chips` and `pipeline/generator_chips` (not yet written
  by the controller: pass them as arguments, or `--split T:G` on the command line);
- `pipeline/mode` (else "async").

Only the two rates and the chip counts are required. Model: both rates are capacities that
scale linearly with chips (per-chip rates held fixed); `analytic.pipeline_rates` combines them
per mode. The weight publish is inside the trainer's rate already, so no sync term is added.
Without a batch size only the run's own mode is compared.
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
TRAINER_BUSY = "pipeline/trainer_busy_s"
STEP = "pipeline/step_s"
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
    """Measured (or published) capacities of one run at one split, samples/s while busy."""

    trainer_chips: int
    generator_chips: int
    trainer_rate: float
    generator_rate: float
    trainer_idle_frac: float | None = None  # measured, for comparison
    weight_sync_s: float | None = None      # measured, for reporting (inside trainer_rate)
    batch_size: int | None = None
    train_mfu: float | None = None          # over the train step (busy time)
    sandbox_exec_s: float | None = None
    mode: str = "async"
    step_s: float | None = None             # measured wall-clock per step, for comparison

    def __post_init__(self):
        check_mode(self.mode)
        if self.trainer_chips < 1 or self.generator_chips < 1:
            raise ValueError(f"chip counts must be >= 1, got trainer={self.trainer_chips} "
                             f"generator={self.generator_chips}")
        if not (self.trainer_rate > 0 and self.generator_rate > 0):
            raise ValueError(f"rates must be > 0, got trainer={self.trainer_rate} "
                             f"generator={self.generator_rate}")
        if self.trainer_idle_frac is not None and not 0 <= self.trainer_idle_frac < 1:
            raise ValueError(f"trainer_idle_frac must be in [0, 1), got "
                             f"{self.trainer_idle_frac}")

    def evaluate(self, trainer_chips: int, generator_chips: int) -> dict[str, ModeRates]:
        t = self.trainer_rate * trainer_chips / self.trainer_chips
        g = self.generator_rate * generator_chips / self.generator_chips
        batch = self.batch_size or 1  # rates only: the overlapped limit min(t, g)
        return {m: pipeline_rates(m, batch, t, g) for m in MODES}


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
    busy = _number(rates, TRAINER_BUSY)
    if not batch and busy:
        batch = round(consumed * busy)
    return MeasuredRates(
        trainer_chips=int(trainer_chips), generator_chips=int(generator_chips),
        trainer_rate=consumed, generator_rate=produced,
        trainer_idle_frac=_number(rates, TRAINER_IDLE), weight_sync_s=_number(rates, SYNC),
        batch_size=int(batch) if batch else None, train_mfu=_number(rates, MFU),
        sandbox_exec_s=_number(rates, SANDBOX_EXEC),
        mode=mode or str(rates.get(MODE) or "async"), step_s=_number(rates, STEP))


def from_measured(rates: Mapping[str, Any] | MeasuredRates, *, total_chips: int | None = None,
                  granularity: int = 1, modes: Sequence[str] | None = None,
                  sandbox_utilization: float = 0.8, cpu_cores: int | None = None,
                  **overrides: Any) -> Recommendation:
    """The split (and mode) of `total_chips` (default: the run's) that maximises consumed
    samples/s, given one run's measured metrics; `gain` is relative to the measured run.

    `overrides` (trainer_chips, generator_chips, batch_size, mode) replace metric values.
    `cpu_cores` (default: this machine's) is what the sandbox note compares its need with.
    """
    m = rates if isinstance(rates, MeasuredRates) else measured_rates(rates, **overrides)
    total = total_chips or m.trainer_chips + m.generator_chips
    if modes is None:
        modes = MODES if m.batch_size is not None else (m.mode,)
    mfu = m.train_mfu
    rec = recommend(total, m.evaluate, granularity=granularity, modes=modes,
                    baseline=(m.trainer_chips, m.generator_chips, m.mode),
                    mfu_of=(lambda t, g, r: mfu * r.train_frac) if mfu else None)
    base = rec.baseline
    notes = [f"measured: trainer {m.trainer_rate:.4g} samples/s on {m.trainer_chips} chips, "
             f"generator {m.generator_rate:.4g} samples/s on {m.generator_chips} chips (rates "
             f"while busy), mode {m.mode}"]
    if m.trainer_idle_frac is not None and base is not None:
        notes.append(f"trainer idle: measured {m.trainer_idle_frac:.1%}, predicted "
                     f"{base.rates.trainer_idle:.1%} at the measured split")
    if m.step_s is not None and base is not None and m.batch_size is not None:
        notes.append(f"step time: measured {m.step_s:.4g} s, predicted {base.rates.step_s:.4g} s "
                     f"({base.rates.step_s / m.step_s - 1:+.1%}) at the measured split")
    if m.weight_sync_s is not None:
        notes.append(f"weight sync: {m.weight_sync_s:.3g} s per step (inside the trainer rate)")
    if m.sandbox_exec_s:
        notes.append(_sandbox_note(rec.best.rates.consumed_per_s * m.sandbox_exec_s
                                   / sandbox_utilization, m.sandbox_exec_s, sandbox_utilization,
                                   _cores() if cpu_cores is None else cpu_cores))
    if m.batch_size is None:
        notes.append(f"no {BATCH} (or pipeline/trainer_busy_s) recorded: only mode {m.mode!r} "
                     f"compared")
    return dataclasses.replace(rec, notes=tuple(notes))


def _cores() -> int:
    """The CPU cores this process may use."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def _sandbox_note(cores: float, exec_s: float, utilization: float, have: int) -> str:
    """The CPU cores the rewards need at the recommended split, against the `have` there are
    (a note never claims more cores than the machine has)."""
    need = math.ceil(cores)
    why = f"({exec_s:.3g} s per sample at {utilization:.0%} busy)"
    if need <= have:
        cores_keep = "1 CPU core keeps" if need == 1 else f"{need} CPU cores keep"
        return (f"sandbox: {cores_keep} up with the recommended split {why}; this machine has "
                f"{have}")
    return (f"sandbox: {need} CPU cores would keep up with the recommended split {why}, but this "
            f"machine has {have}: the rewards limit the rate there (run the sandbox pool on more "
            "cores, e.g. --rewards.backend=ray)")


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
