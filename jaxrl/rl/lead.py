"""Adaptive staleness (`pipeline.lead=auto`): how many versions the generator may run ahead.

The statistic is M2PO's: the second moment of the log importance ratio between the policy the
trainer holds and the behaviour policy that sampled a batch, over the batch's loss tokens,

    M2 = mean_t (log pi_theta(y_t) - log mu(y_t))^2

(Zheng et al. 2025, "Prosperity before Collapse: How Far Can Off-Policy RL Reach with Stale Data
on LLMs?", who bound the same quantity by tau = 0.04 when masking tokens). The trainer reports it
for every batch as `is/behaviour_m2` (jaxrl.train.objective). A batch `s` versions stale drifts
over `s` updates, so the rule divides by the batch's mean staleness to get the drift per version
(a fresh batch, staleness 0, measures only the numerical mismatch and is skipped), smooths it over
recent batches (an exponential average) and predicts `M2(k) = drift * k` for a lead `k`:

    lower at once to the largest k with drift * k <= tau          (drift grew)
    raise by one when drift * (k + 1) < raise_frac * tau           (drift small),
        and at least `patience` steps have passed since the last change

    at lead 0 (every batch fresh, so no drift is measured) try 1 after `probe_after` steps

The band between `raise_frac * tau` and `tau` is the hysteresis: a lead is neither raised nor
lowered while the prediction lies in it. Pure Python, so it is tested without a model.
"""

from __future__ import annotations

import dataclasses
import math


@dataclasses.dataclass
class LeadRule:
    """The lead 0..k_max from the measured mismatch (see the module docstring)."""

    k_max: int
    tau: float = 0.04  # M2PO's threshold on the second moment of the log ratio
    raise_frac: float = 0.5  # raise only while the predicted M2 at k + 1 is below this * tau
    patience: int = 3  # steps between two changes of the lead
    smoothing: float = 0.5  # weight of the newest batch in the drift average
    probe_after: int = 20  # at lead 0 (fresh batches: no drift measured), try 1 after this many
    lead: int = -1  # the current lead; -1: start at k_max
    drift: float | None = None  # smoothed M2 per version of staleness
    since_change: int = 0

    def __post_init__(self):
        if self.k_max < 0:
            raise ValueError(f"LeadRule: k_max must be >= 0, got {self.k_max}")
        if not (self.tau > 0 and 0 < self.raise_frac < 1 and 0 < self.smoothing <= 1):
            raise ValueError(f"LeadRule: need tau > 0, 0 < raise_frac < 1, 0 < smoothing <= 1; "
                             f"got {self.tau}, {self.raise_frac}, {self.smoothing}")
        if self.lead < 0:
            self.lead = self.k_max

    def update(self, m2: float, staleness_mean: float) -> int:
        """Feed one batch's M2 and its mean staleness (versions); return the lead to use now."""
        self.since_change += 1
        if math.isfinite(m2) and staleness_mean >= 0.5:  # else nothing learned about drift
            per_version = m2 / staleness_mean
            a = self.smoothing
            self.drift = (per_version if self.drift is None
                          else a * per_version + (1 - a) * self.drift)
        if self.drift is None:
            return self.lead
        if self.lead == 0 and self.since_change >= self.probe_after:  # measure the drift again
            self._set(1)
        elif self.drift * self.lead > self.tau:  # drift grew: lower at once, as far as needed
            fits = int(self.tau / self.drift) if self.drift > 0 else self.k_max
            self._set(max(0, min(self.lead - 1, fits)))
        elif (self.lead < self.k_max and self.since_change >= self.patience
              and self.drift * (self.lead + 1) < self.raise_frac * self.tau):
            self._set(self.lead + 1)
        return self.lead

    def _set(self, lead: int) -> None:
        self.lead, self.since_change = lead, 0

    def metrics(self) -> dict[str, float]:
        """The smoothed drift (the loop reports the lead itself as `staleness/lead`)."""
        return {"staleness/drift_m2_per_version": float(self.drift or 0.0)}
