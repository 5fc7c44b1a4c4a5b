"""Choose the trainer:generator split and pipeline mode that consume the most samples per second.

`recommend` is model-agnostic: it takes an `evaluate(trainer_chips, generator_chips)` function
returning each mode's `ModeRates` (or raising `Infeasible`). The analytic model provides one
(`analytic_evaluator`), and so do measured rates scaled per chip (`jaxrl.planner.measured`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence

from jaxrl.planner.analytic import MODES, Infeasible, ModeRates, check_mode, predict
from jaxrl.planner.hardware import HardwareSpec
from jaxrl.planner.specs import Efficiency, ModelSpec, Workload

Evaluator = Callable[[int, int], Mapping[str, ModeRates]]


@dataclasses.dataclass(frozen=True)
class SplitResult:
    trainer_chips: int
    generator_chips: int
    rates: ModeRates
    mfu: float | None = None  # trainer MFU over wall-clock, when the busy MFU is known

    @property
    def split(self) -> str:
        return f"{self.trainer_chips}:{self.generator_chips}"


@dataclasses.dataclass(frozen=True)
class Recommendation:
    total_chips: int
    best: SplitResult
    baseline: SplitResult | None
    candidates: tuple[SplitResult, ...]  # every feasible (split, mode), best first
    notes: tuple[str, ...] = ()  # extra advice (e.g. sandbox cores), printed with the table

    @property
    def gain(self) -> float | None:
        """Predicted relative throughput gain of `best` over `baseline` (0.15 = +15%)."""
        if self.baseline is None:
            return None
        return self.best.rates.consumed_per_s / self.baseline.rates.consumed_per_s - 1

    def best_per_mode(self) -> dict[str, SplitResult]:
        out: dict[str, SplitResult] = {}
        for c in self.candidates:
            out.setdefault(c.rates.mode, c)
        return out


def split_candidates(total_chips: int, granularity: int) -> list[tuple[int, int]]:
    if total_chips < 2:
        raise ValueError(f"need at least 2 chips to split, got {total_chips}")
    g = granularity if total_chips >= 2 * granularity else 1
    return [(t, total_chips - t) for t in range(g, total_chips - g + 1, g)]


def recommend(total_chips: int, evaluate: Evaluator, *, granularity: int = 1,
              modes: Sequence[str] = MODES, baseline: tuple[int, int, str] | None = None,
              mfu_of: Callable[[int, int, ModeRates], float | None] | None = None
              ) -> Recommendation:
    """Evaluates every split in steps of `granularity` chips and every allowed mode.

    `baseline` is (trainer_chips, generator_chips, mode) of the split to compare against; it
    may use any chip count. Raises ValueError if no split is feasible.
    """
    modes = [check_mode(m) for m in modes]
    mfu_of = mfu_of or (lambda t, g, r: None)

    def results(t: int, g: int, allowed: Sequence[str]) -> list[SplitResult]:
        rates = evaluate(t, g)
        return [SplitResult(t, g, rates[m], mfu_of(t, g, rates[m])) for m in allowed]

    candidates: list[SplitResult] = []
    reasons: list[str] = []
    for t, g in split_candidates(total_chips, granularity):
        try:
            candidates += results(t, g, modes)
        except Infeasible as e:
            reasons.append(f"{t}:{g}: {e}")
    if not candidates:
        raise ValueError(f"no feasible split of {total_chips} chips; e.g. " + "; ".join(
            reasons[:3]))
    candidates.sort(key=lambda c: (-c.rates.consumed_per_s, MODES.index(c.rates.mode)))
    base = None
    if baseline is not None:
        t, g, mode = baseline
        base = results(t, g, [check_mode(mode)])[0]
    return Recommendation(total_chips, candidates[0], base, tuple(candidates))


def analytic_evaluator(model: ModelSpec, hw: HardwareSpec, workload: Workload, eff: Efficiency,
                       *, staleness: int = 1) -> Evaluator:
    return lambda t, g: predict(model, hw, workload, eff, t, g, staleness=staleness).modes


def recommend_analytic(model: ModelSpec, hw: HardwareSpec, workload: Workload, eff: Efficiency,
                       total_chips: int, *, modes: Sequence[str] = MODES,
                       baseline: tuple[int, int, str] | None = None, staleness: int = 1,
                       granularity: int | None = None) -> Recommendation:
    """The analytic model's best split of `total_chips`; splits move whole nodes by default."""
    return recommend(
        total_chips, analytic_evaluator(model, hw, workload, eff, staleness=staleness),
        granularity=granularity or hw.chips_per_node, modes=modes, baseline=baseline,
        mfu_of=lambda t, g, r: eff.trainer_mfu * r.train_frac)
