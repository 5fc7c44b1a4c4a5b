"""Live rebalancing policy: when to move chips between the trainer and the generator.

One pure policy, fed measured rates by the controller (`pipeline.rebalance=auto`,
jaxrl/rl/rebalance.py) and simulated ones by `simulate_rebalancing` below, so the policy
studied at the published scale is the one a run uses. The model is the planner's
(docs/planner.md, "Closing the loop"): per-chip rates are held fixed, so at a split T:G the
trainer consumes `t*T` and the generator produces `g*G` samples per busy second, and
`analytic.pipeline_rates` combines them per mode. Per step the policy

1. smooths the per-chip rates `t = consumed/T` and `g = produced/G` (exponential average);
2. predicts the throughput of every feasible split in steps of `granularity` chips;
3. names the best one a candidate when the relative gain exceeds `margin` and the move pays for
   itself before the run ends: with `steps_left` known, (seconds saved per step x the steps
   left once the candidate is compiled) > (the pause + the compile cost not yet hidden); with
   no end known, the gain over `horizon_s` pays for the same cost in samples. No move in the
   run's last `final_steps` steps;
4. moves to the candidate once it was named on `confirm` consecutive steps, at least
   `min_interval` steps have passed since the last move, and it is compiled (`ready`): a run
   compiles a candidate's executables ahead on a background thread (jaxrl/rl/compile_ahead.py),
   so once ready its compile cost is spent and only the pause is left to pay.

`margin` and `confirm` are the hysteresis: a move changes the split only for a gain that rate
noise does not explain, and moving back needs the same. The pause starts at `cost_s` and becomes
the measured one after each move (`moved`, then `add_cost` for what the move costs later: in a
live run, compilation the compile-ahead missed). The compile cost (what compiling in the
background slows the running steps by, and how long it takes) starts at `compile_cost_s`
(default: `cost_s`) and becomes the measured one (`compiled`). Every decision carries its
predicted rate and payback (the steps its gain takes to repay its cost), compared with those
measured after it (`Decision.measured_rate`, `measured_payback_steps`, filled in later).
`last_reason` says why the last step did not move.

`simulate_rebalancing` is a step-level simulation (each step's time from `pipeline_rates` at the
split, noisy measured rates, a move's cost added to wall time), not the discrete-event
simulator of `simulate.py`, whose split is fixed for a run.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np

from jaxrl.planner.analytic import pipeline_rates


@dataclasses.dataclass(frozen=True)
class RebalanceConfig:
    granularity: int = 1  # chips per move unit (8: whole 8-GPU nodes)
    margin: float = 0.03  # relative gain a move must promise beyond its cost
    min_interval: int = 5  # steps between two moves (and before the first)
    horizon_s: float = 600.0  # seconds over which a move must pay for itself
    cost_s: float = 30.0  # assumed cost of a move until one is measured
    smoothing: float = 0.3  # weight of the newest step in the rate averages
    confirm: int = 3  # consecutive steps that must propose the same move before it is made
    final_steps: int = 2  # no move when this many steps or fewer are left
    compile_cost_s: float | None = None  # assumed compile-ahead cost until measured (cost_s)

    def __post_init__(self):
        if self.granularity < 1 or self.min_interval < 0 or self.margin < 0 or self.confirm < 1:
            raise ValueError(f"RebalanceConfig: need granularity >= 1, min_interval >= 0, "
                             f"margin >= 0, confirm >= 1; got {self.granularity}, "
                             f"{self.min_interval}, {self.margin}, {self.confirm}")
        if self.final_steps < 0 or not (self.compile_cost_s is None or self.compile_cost_s >= 0):
            raise ValueError(f"RebalanceConfig: need final_steps >= 0, compile_cost_s >= 0 (or "
                             f"None); got {self.final_steps}, {self.compile_cost_s}")
        if not (self.horizon_s > 0 and self.cost_s >= 0 and 0 < self.smoothing <= 1):
            raise ValueError(f"RebalanceConfig: need horizon_s > 0, cost_s >= 0, 0 < smoothing "
                             f"<= 1; got {self.horizon_s}, {self.cost_s}, {self.smoothing}")


@dataclasses.dataclass
class Decision:
    step: int
    old: tuple[int, int]  # trainer:generator chips before
    new: tuple[int, int]
    current_rate: float  # predicted samples/s at the old split (from the smoothed rates)
    predicted_rate: float  # predicted at the new split
    cost_s: float  # the cost assumed when deciding
    measured_cost_s: float | None = None
    measured_rate: float | None = None  # consumed samples/s measured after the move
    steps_left: int | None = None  # steps the run had left after the move (None: unbounded)
    gain_s: float = float("nan")  # predicted seconds saved per step (a batch each)
    measured_gain_s: float | None = None  # measured: step time before - after

    @property
    def payback_steps(self) -> float:
        """Predicted steps until the gain repays the move's cost."""
        return self.cost_s / self.gain_s if self.gain_s > 0 else float("inf")

    @property
    def measured_payback_steps(self) -> float | None:
        if self.measured_gain_s is None or self.measured_cost_s is None:
            return None
        g = self.measured_gain_s
        return self.measured_cost_s / g if g > 0 else float("inf")

    def log_line(self) -> str:
        meas = "" if self.measured_rate is None else f", measured {self.measured_rate:.3g}/s"
        if self.measured_cost_s is not None:
            meas += f", measured cost {self.measured_cost_s:.3g}s"
        if self.measured_payback_steps is not None:
            meas += f", measured payback {self.measured_payback_steps:.3g} steps"
        left = "" if self.steps_left is None else f" of {self.steps_left} left"
        return (f"rebalance at step {self.step}: {self.old[0]}:{self.old[1]} -> "
                f"{self.new[0]}:{self.new[1]}, predicted {self.current_rate:.3g} -> "
                f"{self.predicted_rate:.3g} samples/s, move cost {self.cost_s:.3g}s, predicted "
                f"payback {self.payback_steps:.3g} steps{left}{meas}")


Feasible = Callable[[int, int], bool]


class Rebalancer:
    """The policy's state: smoothed per-chip rates, the split, the move cost, the decisions."""

    def __init__(self, total: int, trainer_chips: int, cfg: RebalanceConfig | None = None, *,
                 mode: str = "periodic", batch: int = 1, staleness: int = 1,
                 feasible: Feasible | None = None):
        self.cfg = cfg or RebalanceConfig()
        self.total, self.split = total, (trainer_chips, total - trainer_chips)
        self.mode, self.batch, self.staleness = mode, batch, staleness
        self.feasible = feasible or (lambda t, g: t >= 1 and g >= 1)
        self.t_rate: float | None = None  # samples/s of trainer busy time per trainer chip
        self.g_rate: float | None = None
        self.cost_s = self.cfg.cost_s
        cc = self.cfg.compile_cost_s
        # compile-ahead: its cost to the running steps, and its wall time (steps it delays)
        self.compile_cost_s = self.compile_wall_s = self.cfg.cost_s if cc is None else cc
        # split -> (wall, cost) of compiling it ahead, when a run knows better per split (a
        # split in the persistent cache loads): overrides the measured pair above
        self.compile_estimate: Callable[[tuple[int, int]], tuple[float, float]] | None = None
        self.candidate: tuple[int, int] | None = None  # the split worth compiling, if any
        self.last_reason = ""
        self.since_move = 0
        self._proposed: tuple[tuple[int, int] | None, int] = (None, 0)  # (target, times)
        self.decisions: list[Decision] = []

    def throughput(self, trainer_chips: int, generator_chips: int) -> float:
        """Predicted consumed samples/s at a split, from the smoothed per-chip rates."""
        return pipeline_rates(self.mode, self.batch, self.t_rate * trainer_chips,
                              self.g_rate * generator_chips,
                              staleness=self.staleness).consumed_per_s

    def candidates(self) -> list[tuple[int, int]]:
        g = self.cfg.granularity
        out = [(t, self.total - t) for t in range(g, self.total, g)]
        return [s for s in out if s == self.split or self.feasible(*s)]

    def observe(self, consumed_per_s: float, produced_per_s: float) -> None:
        """One step's measured rates (samples per busy second of each role, at `self.split`)."""
        t, g = consumed_per_s / self.split[0], produced_per_s / self.split[1]
        if not (np.isfinite(t) and np.isfinite(g) and t > 0 and g > 0):
            return
        a = self.cfg.smoothing
        self.t_rate = t if self.t_rate is None else a * t + (1 - a) * self.t_rate
        self.g_rate = g if self.g_rate is None else a * g + (1 - a) * self.g_rate
        if self.decisions and self.decisions[-1].measured_rate is None:
            self.decisions[-1].measured_rate = float(min(consumed_per_s, produced_per_s))
        self.since_move += 1

    def skip(self) -> None:
        """A step whose rates are not observed (they are the compiler's) still counts toward
        `min_interval`."""
        self.since_move += 1

    def decide(self, step: int, remaining_samples: float | None = None, *,
               steps_left: int | None = None,
               ready: Callable[[tuple[int, int]], bool] | None = None) -> Decision | None:
        """The move to make now, or None (see the module docstring; `last_reason` says why not,
        `candidate` is the split worth compiling ahead). `steps_left`: the run's steps after
        this one (None: unbounded, the gain is judged over `horizon_s`, at most the time
        `remaining_samples` take at the new split). `ready(split)`: whether the split is
        compiled (None: always; a split not ready is not moved to, and its compile cost and
        the steps it takes count against it)."""
        self.candidate = None
        if self.t_rate is None:
            return self._no("no rates measured yet")
        if steps_left is not None and steps_left <= self.cfg.final_steps:
            return self._no(f"{steps_left} steps left: no move in the last "
                            f"{self.cfg.final_steps}")
        current = self.throughput(*self.split)
        best = max(self.candidates(), key=lambda s: self.throughput(*s))
        predicted = self.throughput(*best)
        gain = predicted - current
        if best == self.split or gain <= self.cfg.margin * current:
            return self._no(f"the best split {best[0]}:{best[1]} gains {gain / current:.1%} "
                            f"(margin {self.cfg.margin:.0%})")
        compiled = ready is None or ready(best)
        wall_s, compile_s = ((self.compile_wall_s, self.compile_cost_s)
                             if self.compile_estimate is None else self.compile_estimate(best))
        cost = self.cost_s + (0.0 if compiled else compile_s)
        gain_s = self.batch / current - self.batch / predicted  # seconds saved per step
        if steps_left is not None:
            wait = 0 if compiled else int(np.ceil(wall_s * current / self.batch))
            won, why = gain_s * max(steps_left - wait, 0), (
                f"{gain_s:.3g}s/step x {steps_left - wait} steps left after compiling" if wait
                < steps_left else f"compiling it takes ~{wait} steps, {steps_left} are left")
        else:
            horizon = self.cfg.horizon_s
            if remaining_samples is not None and predicted > 0:
                horizon = min(horizon, remaining_samples / predicted)
            won, why = gain * horizon / current, f"{gain:.3g} samples/s over {horizon:.3g}s"
        if not won > cost:  # in seconds of the current split's time
            return self._no(f"{self.split[0]}:{self.split[1]} -> {best[0]}:{best[1]} does not "
                            f"pay: {why} = {won:.3g}s <= cost {cost:.3g}s (pause "
                            f"{self.cost_s:.3g}s + compile {cost - self.cost_s:.3g}s)")
        self.candidate = best
        if self.since_move < self.cfg.min_interval:
            return self._no(f"{self.since_move} of {self.cfg.min_interval} steps since a move")
        times = self._proposed[1] + 1 if self._proposed[0] == best else 1
        self._proposed = (best, times)
        if times < self.cfg.confirm:
            return self._no(f"{best[0]}:{best[1]} named {times} of {self.cfg.confirm} times")
        if not compiled:
            return self._no(f"{best[0]}:{best[1]} is still compiling")
        self._proposed = (None, 0)
        self.last_reason = ""
        return Decision(step, self.split, best, current, predicted, cost, steps_left=steps_left,
                        gain_s=gain_s)

    def _no(self, reason: str) -> None:
        if self.candidate is None:
            self._proposed = (None, 0)
        self.last_reason = reason
        return None

    def hold(self, decision: Decision) -> None:
        """A decision not carried out (another process did not agree): named again at once."""
        self._proposed = (decision.new, self.cfg.confirm - 1)

    def compiled(self, wall_s: float, cost_s: float) -> None:
        """A compile-ahead took `wall_s` on its thread and slowed the running steps by `cost_s`:
        the next candidates assume these."""
        self.compile_wall_s, self.compile_cost_s = wall_s, cost_s

    def moved(self, decision: Decision, measured_cost_s: float) -> None:
        """The move was made: it took `measured_cost_s` (the next decisions assume that)."""
        decision.measured_cost_s = measured_cost_s
        self.split, self.cost_s, self.since_move = decision.new, measured_cost_s, 0
        self.decisions.append(decision)

    def add_cost(self, decision: Decision, extra_s: float) -> None:
        """The move `decision` also cost `extra_s` after it was made (a live run: the first step
        after a move recompiles the step and the engine); the next decisions assume the sum."""
        decision.measured_cost_s = (decision.measured_cost_s or 0.0) + extra_s
        self.cost_s = decision.measured_cost_s


@dataclasses.dataclass
class RebalanceSim:
    splits: list[tuple[int, int]]  # split of each step
    step_s: np.ndarray  # wall time of each step (a move's cost added to the step it follows)
    consumed_per_s: np.ndarray  # each step's throughput at its split (noise-free)
    decisions: list[Decision]
    batch: int

    def steady_from(self, step: int) -> float:
        """Consumed samples/s over the steps from `step` on (moves' costs included)."""
        return float(self.batch * len(self.step_s[step:]) / np.sum(self.step_s[step:]))


def simulate_rebalancing(trainer_rate_per_chip: float, generator_rate_per_chip: float,
                         total: int, trainer_chips: int, *, steps: int, batch: int = 1,
                         mode: str = "periodic", cfg: RebalanceConfig | None = None,
                         move_cost_s: float = 30.0, noise: float = 0.05, seed: int = 0,
                         feasible: Feasible | None = None, compile_s: float | None = None,
                         compile_overhead: float = 0.0) -> RebalanceSim:
    """A run of `steps` steps at the step level: each step's time follows `pipeline_rates` at the
    current split, the policy sees the rates with multiplicative log-normal noise (`noise`), and
    a move pauses both roles for `move_cost_s`. Batches are in units of samples.

    `compile_s`: compile before moving (None: not modelled, every split ready). A candidate the
    policy names is compiled in the background for `compile_s` seconds of run time, slowing the
    steps beside it by the fraction `compile_overhead`; the policy moves only to a compiled
    split (the initial one is)."""
    rng = np.random.default_rng(seed)
    pol = Rebalancer(total, trainer_chips, cfg, mode=mode, batch=batch, feasible=feasible)
    if compile_s is not None:
        pol.compiled(compile_s, compile_s * compile_overhead)
    compiled, compiling = {pol.split}, None  # (split, seconds left)
    ready = None if compile_s is None else (lambda s: s in compiled)
    splits, step_s, rates = [], [], []
    for step in range(steps):
        t_chips, g_chips = pol.split
        r = pipeline_rates(mode, batch, trainer_rate_per_chip * t_chips,
                           generator_rate_per_chip * g_chips)
        seconds = r.step_s
        if compiling is not None:  # a step beside the compile-ahead
            seconds *= 1 + compile_overhead
            compiling = (compiling[0], compiling[1] - seconds)
            if compiling[1] <= 0:
                compiled.add(compiling[0])
                compiling = None
        splits.append(pol.split)
        step_s.append(seconds)
        rates.append(r.consumed_per_s)
        eps = rng.lognormal(0.0, noise, 2)
        pol.observe(trainer_rate_per_chip * t_chips * eps[0],
                    generator_rate_per_chip * g_chips * eps[1])
        decision = pol.decide(step, remaining_samples=(steps - step - 1) * batch, ready=ready,
                              steps_left=None if compile_s is None else steps - step - 1)
        if decision is not None:
            step_s[-1] += move_cost_s
            pol.moved(decision, move_cost_s)
        elif pol.candidate is not None and ready is not None and compiling is None and \
                pol.candidate not in compiled:
            compiling = (pol.candidate, compile_s)
    return RebalanceSim(splits, np.asarray(step_s), np.asarray(rates), pol.decisions, batch)
