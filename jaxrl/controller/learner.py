"""`Learner`: the trainer side of one RL step, which the pipeline calls, plus the run's hooks.

    learner.train(step, produced)   staleness bound → batch → Trainer.step → (metrics, params)
    learner.publish(params, v)      weight sync: trainer params → generator params (+ timing)
    learner.on_step(step, metrics)  completes the metrics row, runs the hooks due at this step
    learner.finish()                the last step's trainer metrics, the end hooks, the last row

`Trainer.step` returns the PREVIOUS step's metrics (the host never waits on the update it just
dispatched), so the row of step `s` is complete when step `s + 1` has been dispatched, or at
`finish()`. Hooks, `add_hook(fn, every=n, on=...)`, come in two kinds:

  on="step"  after step `s` is trained: `fn(steps_done, row)` with `steps_done = s + 1` and `row`
             the row being built for step `s` (the hook may add to it): checkpoints, evaluation;
  on="row"   when the row of step `s` is complete: `fn(s, row)`: the metrics log, planner advice.

`every=n` runs a hook when `steps_done` (step hooks) or `s + 1` (row hooks) is a multiple of n;
`every=0` only at the end of the run; `at_end=True` at the end as well.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax

from jaxrl.controller.buffer import apply_staleness_bound, groups_to_batch, staleness_stats
from jaxrl.controller.lead import LeadRule
from jaxrl.controller.pipeline import Produced


@dataclasses.dataclass
class Hook:
    fn: Callable[[int, dict], None]
    every: int
    at_end: bool
    on: str

    def due(self, steps_done: int, *, end: bool) -> bool:
        if end:
            return self.at_end or self.every == 0
        return self.every > 0 and steps_done % self.every == 0


class Learner:
    def __init__(self, *, trainer, sync, pipeline_cfg, processes, data_states,
                 row_metrics: Callable[[], dict], constants: dict | None = None):
        self.trainer, self.sync, self.cfg = trainer, sync, pipeline_cfg
        self.processes, self.data_states = processes, data_states
        self.row_metrics = row_metrics
        self.constants = dict(constants or {})
        self.hooks: list[Hook] = []
        self._ending = False  # inside finish(): row hooks run as end hooks
        self._prev: dict | None = None  # trainer metrics of the step before the current one
        self._pending: tuple[int, dict] | None = None  # (step, row) waiting for those metrics
        # pipeline.lead=auto: the lead follows the drift the trainer measures (one step late)
        self.lead_rule = (LeadRule(k_max=pipeline_cfg.max_staleness, tau=pipeline_cfg.lead_tau)
                          if pipeline_cfg.lead == "auto" else None)
        self._staleness_mean = 0.0  # of the batch whose trainer metrics come next

    def add_hook(self, fn: Callable[[int, dict], None], *, every: int = 1,
                 at_end: bool = False, on: str = "step") -> None:
        if every < 0:
            raise ValueError(f"hook every={every}: must be >= 0 (0 = only at the end)")
        if on not in ("step", "row"):
            raise ValueError(f"hook on={on!r}: valid choices: ['step', 'row']")
        self.hooks.append(Hook(fn, every, at_end, on))

    def _run_hooks(self, on: str, n: int, arg: int, row: dict, *, end: bool) -> None:
        for hook in self.hooks:
            if not end and hook.at_end and n == self.cfg.steps:
                continue  # due at the last step too: it runs once, at the end
            if hook.on == on and hook.due(n, end=end):
                hook.fn(arg, row)

    def _complete(self, *, end: bool = False) -> None:
        step, row = self._pending
        self._pending = None
        self._run_hooks("row", step + 1, step, row, end=end or self._ending)

    def complete_row(self) -> None:
        """Finish the pending row now (waits for the update in flight): a checkpoint hook calls
        it, so that every row before the checkpoint's step is written before the checkpoint
        (a stop between the two would otherwise lose that row on resume). Register such a hook
        after the hooks that add to the row."""
        if self._pending is None:
            return
        last = self.trainer.flush()
        if last is not None:
            self._pending[1].update(last)
        self._prev = None
        self._complete()

    # ---------------------------------------------------------------- pipeline callbacks

    def train(self, step: int, produced: Produced) -> tuple[dict, object]:
        groups = self.processes.global_groups(produced.payload)
        self.data_states.commit(step)
        # the global batch (several processes): the pipeline's consumed rate counts all of it
        produced.num_rollouts = num_rollouts = sum(len(g.rollouts) for g in groups)
        pc = self.cfg
        groups, dropped, downweighted = apply_staleness_bound(
            groups, step, max_staleness=pc.max_staleness, policy=pc.stale_policy,
            weight=pc.stale_weight)
        if not groups:  # config validation rules this out; say so rather than train on nothing
            raise RuntimeError(f"step {step}: every group exceeded the staleness bound "
                               f"{pc.max_staleness} and was dropped")
        self._prev = self.trainer.step(groups_to_batch(groups), seed_step=step)
        stale = staleness_stats(groups, step)
        self._update_lead(stale["staleness/mean"])
        # wait for the update here, so that the trace's train_step span (and not the weight
        # sync that follows and would wait for it anyway) holds the trainer's compute
        jax.block_until_ready(self.trainer.state.params)
        metrics = dict(produced.metrics)
        metrics.update(stale)
        if self.lead_rule is not None:
            metrics.update(self.lead_rule.metrics())
        metrics["staleness/dropped_groups"] = float(dropped)
        metrics["staleness/downweighted_groups"] = float(downweighted)
        metrics["pipeline/batch_size"] = float(num_rollouts)
        metrics.update(self.constants)
        return metrics, self.trainer.state.params

    def _update_lead(self, staleness_mean: float) -> None:
        """Feed the previous batch's M2 (its trainer metrics arrive now) to the lead rule."""
        prev_staleness, self._staleness_mean = self._staleness_mean, staleness_mean
        if self.lead_rule is not None and self._prev and "is/behaviour_m2" in self._prev:
            self.lead_rule.update(self._prev["is/behaviour_m2"], prev_staleness)

    def lead(self) -> int:
        """The lead the generator may run ahead now (`Pipeline(lead=...)`; pipeline.lead=auto)."""
        return self.lead_rule.lead if self.lead_rule is not None else self.cfg.max_staleness

    def publish(self, params, version: int):
        return self.sync.publish(params, version)

    def on_step(self, step: int, metrics: dict) -> None:
        if self._prev is not None and self._pending is not None:
            self._pending[1].update(self._prev)
            self._complete()
        self._prev = None
        metrics.update(self.row_metrics())
        row = self.processes.reduce_metrics(metrics)
        self._pending = (step, row)
        self._run_hooks("step", step + 1, step + 1, row, end=False)

    def finish(self, steps_done: int) -> None:
        """After the pipeline: the last trainer metrics, the end hooks, the last row."""
        last = self.trainer.flush()
        if self._pending is None:  # no step ran (a resumed run that was already complete)
            return
        row = self._pending[1]
        if last is not None:
            row.update(last)
        self._ending = True
        self._run_hooks("step", steps_done, steps_done, row, end=True)
        if self._pending is not None:  # a hook may have completed it (complete_row)
            self._complete(end=True)
