"""Several optimizer updates per rollout batch: `train.mini_batches` x `train.epochs`.

    plan = plan_updates(group_ids_B, valid_B, mini_batches=4, epochs=2, seed=(run_seed, step))
    for rows in plan.updates:                  # 8 updates: 2 seeded shuffles x 4 mini-batches
        mb = take_rows(batch, rows, plan)      # on the device, one fixed shape for every update

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


@jax.jit
def _gather(batch: Batch, idx_R, gid_R, keep_R):
    def take(x):
        return None if x is None else jnp.take(x, idx_R, axis=0)

    out = jax.tree.map(take, batch)
    keep_R1 = keep_R[:, None]
    return out.replace(segment_ids=out.segment_ids * keep_R1.astype(out.segment_ids.dtype),
                       loss_mask=out.loss_mask * keep_R1.astype(out.loss_mask.dtype),
                       group_ids=gid_R)


def take_rows(batch: Batch, update: tuple[np.ndarray, np.ndarray], rows: int) -> Batch:
    """The mini-batch of one update from a device batch, padded to `rows` rows (padding rows
    repeat row 0 with no token and no loss)."""
    idx, gid = update
    pad = rows - len(idx)
    keep = np.concatenate([np.ones(len(idx), bool), np.zeros(pad, bool)])
    idx = np.concatenate([idx, np.zeros(pad, np.int32)])
    gid = np.concatenate([gid, np.zeros(pad, np.int32)])
    return _gather(batch, jnp.asarray(idx), jnp.asarray(gid), jnp.asarray(keep))


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
