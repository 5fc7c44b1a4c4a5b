"""The update verb of the RL step: one batch of scored groups → `Trainer.step` → metrics.

    update = Update(cfg.pipeline, processes, data_states)
    metrics = update(step, produced, trainer)     # the loop calls it (jaxrl/rl/loop.py)

It gathers every process's groups, marks the step's data as trained on (what a checkpoint
saves), applies the staleness bound (`pipeline.max_staleness`: drop or down-weight older groups),
builds the batch, steps the trainer and returns the step's metrics. With `pipeline.lead=auto`
it feeds the measured drift to the lead rule (jaxrl/rl/lead.py), whose `lead()` the loop reads.
To change how the update batches, edit this module; the RL maths are jaxrl/train/algorithms.py.
"""

from __future__ import annotations

import math

from jaxrl.rl.buffer import apply_staleness_bound, groups_to_batch, staleness_stats
from jaxrl.rl.lead import LeadRule
from jaxrl.rl.rollout import Produced


class Update:
    def __init__(self, pipeline_cfg, processes, data_states):
        self.cfg, self.processes, self.data_states = pipeline_cfg, processes, data_states
        self.lead_rule = (LeadRule(k_max=pipeline_cfg.max_staleness, tau=pipeline_cfg.lead_tau)
                          if pipeline_cfg.lead == "auto" else None)

    def __call__(self, step: int, produced: Produced, trainer) -> dict:
        groups = self.processes.global_groups(produced.groups)
        self.data_states.commit(step)
        num_rollouts = sum(len(g.rollouts) for g in groups)  # of every process
        pc = self.cfg
        groups, dropped, downweighted = apply_staleness_bound(
            groups, step, max_staleness=pc.max_staleness, policy=pc.stale_policy,
            weight=pc.stale_weight)
        if not groups:  # config validation rules this out; say so rather than train on nothing
            raise RuntimeError(f"step {step}: every group exceeded the staleness bound "
                               f"{pc.max_staleness} and was dropped")
        trained = trainer.step(groups_to_batch(groups), seed_step=step)
        metrics = dict(produced.metrics)
        metrics.update(staleness_stats(groups, step))
        if self.lead_rule is not None:
            self.lead_rule.update(trained.get("is/behaviour_m2", math.nan),
                                  metrics["staleness/mean"])
            metrics.update(self.lead_rule.metrics())
        metrics["staleness/dropped_groups"] = float(dropped)
        metrics["staleness/downweighted_groups"] = float(downweighted)
        metrics["pipeline/batch_size"] = float(num_rollouts)
        metrics.update(trained)
        return metrics

    def lead(self) -> int:
        """The lead the generator may run ahead now (`pipeline.lead=auto`)."""
        return self.lead_rule.lead if self.lead_rule is not None else self.cfg.max_staleness
