"""Dynamic-sampling helpers: per-prompt solve rates, zero-variance group filtering, prompt skipping.

    tracker = SolveRateTracker(min_samples=16, skip_solved=True, skip_unsolved=False)
    keep = tracker.update_groups(uids, rewards_GxN)   # records outcomes; True = group has variance
    tracker.should_skip(uid)                          # PromptIterator asks this while batching

A group (the n samples of one prompt) whose rewards are all equal gives every sample the same
advantage, zero under GRPO: it costs a train step's compute and teaches nothing (DAPO's dynamic
sampling drops such groups). `zero_variance_mask` finds them. A prompt seen at least
`min_samples` times with solve rate exactly 1 (or 0) will very likely give a zero-variance group
again; the tracker can skip it before it costs generation.

A sample counts as solved when its reward >= `solved_threshold`. State is JSON-able (`get_state`
/ `set_state`) so it rides in the checkpoint with the iterator.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import numpy as np


def zero_variance_mask(rewards_GxN, atol: float = 1e-6) -> np.ndarray:
    """bool [G]: True where all n rewards of a group are equal (within atol)."""
    r = np.asarray(rewards_GxN, dtype=np.float64)
    if r.ndim != 2:
        raise ValueError(f"rewards must be [groups, samples], got shape {r.shape}")
    return (r.max(axis=1) - r.min(axis=1)) <= atol


class SolveRateTracker:
    """Counts (samples, solved) per prompt uid."""

    def __init__(self, *, min_samples: int = 16, skip_solved: bool = False,
                 skip_unsolved: bool = False, solved_threshold: float = 1.0):
        if min_samples < 1:
            raise ValueError(f"min_samples must be >= 1, got {min_samples}")
        self.min_samples = min_samples
        self.skip_solved = skip_solved
        self.skip_unsolved = skip_unsolved
        self.solved_threshold = solved_threshold
        self._counts: dict[str, list[int]] = {}  # uid -> [samples, solved]
        self.groups_seen = 0
        self.groups_zero_variance = 0

    @classmethod
    def from_config(cls, cfg) -> SolveRateTracker:
        return cls(min_samples=cfg.solve_rate_min_samples, skip_solved=cfg.skip_solved,
                   skip_unsolved=cfg.skip_unsolved)

    def update(self, uid: str, rewards: Sequence[float]) -> None:
        c = self._counts.setdefault(uid, [0, 0])
        c[0] += len(rewards)
        c[1] += int(sum(float(r) >= self.solved_threshold for r in rewards))

    def update_groups(self, uids: Sequence[str], rewards_GxN) -> np.ndarray:
        """Record every group's outcome; returns bool [G], True for groups WITH reward variance."""
        r = np.asarray(rewards_GxN, dtype=np.float64)
        if r.ndim != 2 or r.shape[0] != len(uids):
            raise ValueError(f"rewards shape {r.shape} does not match {len(uids)} groups")
        for uid, row in zip(uids, r, strict=True):
            self.update(uid, row.tolist())
        zero = zero_variance_mask(r)
        self.groups_seen += len(uids)
        self.groups_zero_variance += int(zero.sum())
        return ~zero

    def solve_rate(self, uid: str) -> float | None:
        c = self._counts.get(uid)
        return None if not c or c[0] == 0 else c[1] / c[0]

    def samples(self, uid: str) -> int:
        return self._counts.get(uid, [0, 0])[0]

    def should_skip(self, uid: str) -> bool:
        c = self._counts.get(uid)
        if c is None or c[0] < self.min_samples:
            return False
        return (self.skip_solved and c[1] == c[0]) or (self.skip_unsolved and c[1] == 0)

    def metrics(self) -> dict[str, float]:
        rates = [c[1] / c[0] for c in self._counts.values() if c[0]]
        n = max(len(rates), 1)
        return {
            "data/prompts_tracked": float(len(rates)),
            "data/solve_rate_mean": float(sum(rates) / n),
            "data/always_solved_frac": float(sum(r == 1 for r in rates) / n),
            "data/never_solved_frac": float(sum(r == 0 for r in rates) / n),
            "data/zero_variance_group_frac_total": self.groups_zero_variance
            / max(self.groups_seen, 1),
        }

    def get_state(self) -> dict[str, Any]:
        return {"counts": {k: list(v) for k, v in self._counts.items()},
                "groups_seen": self.groups_seen, "groups_zero_variance": self.groups_zero_variance}

    def set_state(self, state: dict[str, Any]) -> None:
        self._counts = {k: [int(v[0]), int(v[1])] for k, v in state["counts"].items()}
        self.groups_seen = int(state["groups_seen"])
        self.groups_zero_variance = int(state["groups_zero_variance"])
