"""Rollouts, groups, the batch they become, and the staleness bound the trainer applies.

A group is the `n` samples of one prompt. `RolloutBuffer` is the producer's per-step collection:
it drops (and counts) groups whose rewards have zero variance, which carry no GRPO signal (DAPO's
dynamic sampling). The trainer side applies `apply_staleness_bound` to the batch it receives: a
group whose oldest token is more than `max_staleness` versions behind the trainer is dropped, or
kept with a down-weight, as configured. `groups_to_batch` lays groups out as the trainer's rows.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Literal

import numpy as np

from jaxrl.train.batch import Batch, make_batch

StalePolicy = Literal["drop", "downweight"]


@dataclasses.dataclass
class Rollout:
    prompt: list[int]
    completion: list[int]
    logprobs: list[float]  # behaviour log-probabilities, one per completion token
    versions: list[int]  # policy version that produced each completion token
    finish_reason: str = "stop"
    reward: float = 0.0
    # multi-turn: 1 on the model's tokens, 0 on observation tokens (no loss, no behaviour
    # logprob); None: every completion token is the model's
    mask: list[int] | None = None
    # a mixture of experts: the generator's experts [Ls, prompt + completion, K] per token
    # (`jaxrl.generate.scheduler.Completion.routing`); None when not recorded
    routing: np.ndarray | None = None

    @property
    def min_version(self) -> int:
        return min(self.versions) if self.versions else 0


@dataclasses.dataclass
class Group:
    example: dict[str, Any]  # the task example (fields for the reward; never the model input)
    rollouts: list[Rollout]
    weight: float = 1.0  # < 1 when kept despite exceeding the staleness bound

    @property
    def rewards(self) -> np.ndarray:
        return np.asarray([r.reward for r in self.rollouts], np.float64)

    @property
    def zero_variance(self) -> bool:
        rewards = self.rewards
        return bool(rewards.size) and bool(np.all(rewards == rewards[0]))

    @property
    def min_version(self) -> int:
        return min(r.min_version for r in self.rollouts)

    @property
    def num_tokens(self) -> int:
        return sum(len(r.prompt) + len(r.completion) for r in self.rollouts)


@dataclasses.dataclass
class BufferCounters:
    groups_added: int = 0
    zero_variance: int = 0
    groups_taken: int = 0


class RolloutBuffer:
    """FIFO of scored groups that filters (and counts) zero-variance groups. One producer fills
    and empties it within a step (single thread)."""

    def __init__(self, *, filter_zero_variance: bool = True):
        self.filter_zero_variance = filter_zero_variance
        self.counters = BufferCounters()
        self._groups: collections.deque[Group] = collections.deque()

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, group: Group) -> bool:
        """Add a scored group; returns False if it was filtered out (zero reward variance)."""
        self.counters.groups_added += 1
        if self.filter_zero_variance and group.zero_variance:
            self.counters.zero_variance += 1
            return False
        self._groups.append(group)
        return True

    def take(self, num_groups: int) -> list[Group]:
        """Up to `num_groups` groups, oldest first (fewer when the buffer runs dry)."""
        out = [self._groups.popleft() for _ in range(min(num_groups, len(self._groups)))]
        self.counters.groups_taken += len(out)
        return out


def apply_staleness_bound(
    groups: list[Group], trainer_version: int, *, max_staleness: int | None,
    policy: StalePolicy = "drop", weight: float = 0.5,
) -> tuple[list[Group], int, int]:
    """(kept groups, number dropped, number down-weighted) under the staleness bound.

    A group's staleness is `trainer_version` minus the version of its OLDEST token. Groups within
    `max_staleness` (None: no bound) pass unchanged; beyond it, `drop` removes them and
    `downweight` keeps them with `group.weight = weight ** (staleness - max_staleness)`, which
    becomes the rows' `Batch.sample_weights` (their loss terms are scaled by it)."""
    kept, dropped, downweighted = [], 0, 0
    for group in groups:
        excess = trainer_version - group.min_version - (
            max_staleness if max_staleness is not None else 0)
        if max_staleness is None or excess <= 0:
            kept.append(group)
        elif policy == "drop":
            dropped += 1
        else:
            group.weight = weight**excess
            downweighted += 1
            kept.append(group)
    return kept, dropped, downweighted


def staleness_stats(groups: list[Group], trainer_version: int) -> dict[str, float]:
    """Token-weighted staleness (trainer version minus token version) over a batch's model
    tokens: every turn of a multi-turn episode counts with its own version; observation tokens
    (mask 0) are the environment's and are not counted."""
    lags = [trainer_version - v for g in groups for r in g.rollouts
            for v, m in zip(r.versions, r.mask or [1] * len(r.versions), strict=True) if m]
    if not lags:
        return {"staleness/mean": 0.0, "staleness/max": 0.0}
    return {"staleness/mean": float(np.mean(lags)), "staleness/max": float(np.max(lags))}


def groups_to_batch(groups: list[Group], *, with_versions: bool = True) -> Batch:
    """Lay out groups as the trainer's `Batch`: one right-padded row per rollout.

    Row = prompt + completion; the loss covers completion tokens (the model's only, in a
    multi-turn rollout: `Rollout.mask`); behaviour logprobs and versions
    sit at the position of the token they score (see `jaxrl.train.batch`); recorded routing
    becomes `Batch.routed_experts` (-1 for rows without one).
    """
    rows = [(gi, r) for gi, g in enumerate(groups) for r in g.rollouts]
    if not rows:
        raise ValueError("groups_to_batch: no rollouts to lay out")
    length = max(len(r.prompt) + len(r.completion) for _, r in rows)
    b = len(rows)
    tokens = np.zeros((b, length), np.int32)
    segment_ids = np.zeros((b, length), np.int32)
    loss_mask = np.zeros((b, length), np.float32)
    behaviour = np.zeros((b, length), np.float32)
    versions = np.zeros((b, length), np.int32)
    rewards = np.zeros((b,), np.float32)
    group_ids = np.zeros((b,), np.int32)
    weights = np.asarray([groups[gi].weight for gi, _ in rows], np.float32)
    routed = [r.routing for _, r in rows if r.routing is not None]
    experts = None
    if routed:
        ls, _, k = routed[0].shape
        experts = np.full((b, length, ls, k), -1, routed[0].dtype)
    for i, (gi, r) in enumerate(rows):
        p, c = len(r.prompt), len(r.completion)
        if p < 1:
            raise ValueError("a rollout has an empty prompt; position 0 cannot carry loss")
        if len(r.logprobs) != c or len(r.versions) != c:
            raise ValueError(
                f"rollout {i}: {c} completion tokens but {len(r.logprobs)} logprobs and "
                f"{len(r.versions)} versions"
            )
        tokens[i, : p + c] = r.prompt + r.completion
        segment_ids[i, : p + c] = 1
        loss_mask[i, p : p + c] = 1.0 if r.mask is None else np.asarray(r.mask, np.float32)
        behaviour[i, p : p + c] = r.logprobs
        versions[i, p : p + c] = r.versions
        rewards[i] = r.reward
        group_ids[i] = gi
        if experts is not None and r.routing is not None:
            if r.routing.shape[1] != p + c:
                raise ValueError(f"rollout {i}: routing covers {r.routing.shape[1]} tokens, the "
                                 f"rollout has {p + c}")
            experts[i, : p + c] = np.swapaxes(r.routing, 0, 1)
    positions = np.broadcast_to(np.arange(length, dtype=np.int32), (b, length))
    return make_batch(
        tokens, loss_mask, rewards, group_ids, positions=positions, segment_ids=segment_ids,
        behaviour_logprobs=behaviour, versions=versions if with_versions else None,
        sample_weights=weights, routed_experts=experts,
    )
