"""Several optimizer updates per rollout batch: `train.mini_batches` x `train.epochs`.

    plan = plan_updates(group_ids_B, valid_B, mini_batches=4, epochs=2, seed=(run_seed, step))
    for update in plan.updates:                # 8 updates: 2 seeded shuffles x 4 mini-batches
        mb = take_rows(batch, *padded_update(update, plan.rows))  # on the device, one shape

Every update's PPO ratio is taken against the policy that generated the batch (its log-probs are
computed once, before the first update, into `Batch.proximal_logprobs`), as in PPO (Schulman et
al. 2017) and GRPO's mu iterations (Shao et al. 2024, DeepSeekMath). Groups are kept whole in one
mini-batch, so group-normalised advantages are those of the whole batch; each epoch shuffles the
groups with a seed from (run seed, pipeline step, epoch). Mini-batches are padded to the same
row count (padding rows carry no token), so the step compiles once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.rounding import round_up
from jaxrl.train.batch import Batch


@dataclasses.dataclass(frozen=True)
class UpdatePlan:
    updates: tuple[tuple[np.ndarray, np.ndarray], ...]  # per update: (row index, new group id)
    rows: int  # rows of every mini-batch (padded)


def plan_updates(group_ids_B, valid_B, *, mini_batches: int, epochs: int, seed: tuple[int, ...],
                 row_multiple: int = 1) -> UpdatePlan:
    """The rows of each update: per epoch a seeded shuffle of the groups, cut into
    `mini_batches` parts of (nearly) equal group counts, groups kept whole."""
    group_ids_B, valid_B = np.asarray(group_ids_B), np.asarray(valid_B, bool)
    groups = sorted({int(g) for g in group_ids_B[valid_B]})
    if len(groups) < mini_batches:
        raise ValueError(f"train.mini_batches={mini_batches} is more than the batch's "
                         f"{len(groups)} groups (groups are never split across mini-batches)")
    rows_of = {g: np.flatnonzero(valid_B & (group_ids_B == g)) for g in groups}
    rng = np.random.default_rng([*seed, 0x6D62])
    updates, most = [], 1
    for _ in range(epochs):
        order = rng.permutation(len(groups))
        for part in np.array_split(order, mini_batches):
            rows = [rows_of[groups[i]] for i in part]
            idx = np.concatenate(rows)
            new_gid = np.concatenate([np.full(len(r), j, np.int32) for j, r in enumerate(rows)])
            updates.append((idx.astype(np.int32), new_gid))
            most = max(most, len(idx))
    return UpdatePlan(tuple(updates), round_up(most, row_multiple))


def _select(batch: Batch, idx_R, gid_R, keep_R, xp):
    """Rows `idx_R` of `batch` (numpy or jax.numpy `xp`), regrouped as `gid_R`; rows where
    `keep_R` is False carry no token and no loss."""
    out = jax.tree.map(lambda x: None if x is None else xp.take(x, idx_R, axis=0), batch)
    keep_R1 = keep_R[:, None]
    return out.replace(segment_ids=out.segment_ids * keep_R1.astype(out.segment_ids.dtype),
                       loss_mask=out.loss_mask * keep_R1.astype(out.loss_mask.dtype),
                       group_ids=gid_R)


_gather = jax.jit(lambda batch, idx, gid, keep: _select(batch, idx, gid, keep, jnp))


def padded_update(update: tuple[np.ndarray, np.ndarray], rows: int):
    """`(idx_R, gid_R, keep_R)` of one update padded to `rows` rows (padding rows repeat row 0
    with no token and no loss)."""
    idx, gid = update
    pad = rows - len(idx)
    keep = np.concatenate([np.ones(len(idx), bool), np.zeros(pad, bool)])
    idx = np.concatenate([idx, np.zeros(pad, np.int32)])
    gid = np.concatenate([gid, np.zeros(pad, np.int32)])
    return idx, gid, keep


def take_rows(batch: Batch, idx_R, gid_R, keep_R) -> Batch:
    """The mini-batch of one (padded) update from a device batch, on the device."""
    return _gather(batch, jnp.asarray(idx_R), jnp.asarray(gid_R), jnp.asarray(keep_R))


def take_host_rows(batch: Batch, idx_R, gid_R, keep_R) -> Batch:
    """`take_rows` on a host (numpy) batch: the same mini-batch, for planning its layout."""
    return _select(jax.tree.map(np.asarray, batch), idx_R, gid_R, keep_R, np)


def combine_update_metrics(per_update: list[dict[str, float]]) -> dict[str, float]:
    """One row for several updates: the mean of each metric, the sum of the non-finite count,
    and `last/<name>` of the losses, policy statistics and gradient norm of the last update."""
    out = {}
    for k in per_update[0]:
        vals = [m[k] for m in per_update]
        out[k] = float(np.sum(vals)) if k == "train/nonfinite" else float(np.mean(vals))
        if k.startswith(("loss/", "policy/", "is/")) or k == "train/grad_norm":
            out[f"last/{k}"] = float(vals[-1])
    out["train/step"] = float(per_update[-1]["train/step"])
    out["train/updates"] = float(len(per_update))
    return out
