"""Shared prompts in the train step (`train.share_prompts`): each group's prompt runs once.

The n samples of a GRPO group repeat one prompt, and a causal model's prompt activations do not
depend on the completion, so the plain step spends (n - 1) / n of its prompt compute on copies.
`plan_prefix_layout` (host, numpy) finds each group's shared prefix -- the tokens all its rows
hold before the first loss token, less the last one, which each row keeps as the first token of
its suffix (its hidden state predicts the first completion token) -- and lays the batch out for
`jaxrl.models.shared_prefix`: the prefixes `[M, G, P]` per micro-batch and, per row, the suffix
`[S]` cut from its tokens. The rows are reordered so that every micro-batch (rows m, m + M, ...,
`jaxrl.train.step`) holds whole groups; a group too large for the room left is split, each part
computing the prompt once. `jaxrl.train.logprobs.shared_logprobs` maps the suffix
log-probabilities back to the batch's `[B, T]` alignment, so the objective sees what the plain
forward gives at every loss position (the prompt positions, which carry no loss, hold 0).

On the 22.8M GRPO benchmark (16 prompts x 8 samples, 40 prompt + 64 completion tokens) the step
computes 8,944 of its 13,312 tokens' activations (docs/benchmarks.md).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.train.batch import Batch, padded_shape

# Below this fraction of the batch's tokens saved, the plain layout is kept (fewer compiled shapes).
MIN_SAVED_FRACTION = 0.05


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class PrefixLayout:
    """Where each row's computation comes from (shape suffixes: M micro-batches, G prefix slots
    per micro-batch, P prefix tokens, B rows, S suffix tokens, T batch length).

      tokens_MGP, positions_MGP  int32  each micro-batch's prefixes (padded with 0 / 0..P-1)
      lengths_MG     int32  real tokens of each prefix (0: an empty or unused slot)
      group_B        int32  the prefix slot of each row within its micro-batch
      suffix_index_BS  int32  the batch position each suffix token is taken from; -1: none
      inverse_BT     int32  the suffix slot each batch position's log-prob is read from; -1:
                            none (the shared prefix, padding), where the log-prob is 0
    A single layout (`whole`, one micro-batch's slice) has no M axis."""

    tokens_MGP: jax.Array
    positions_MGP: jax.Array
    lengths_MG: jax.Array
    group_B: jax.Array
    suffix_index_BS: jax.Array
    inverse_BT: jax.Array

    def whole(self) -> PrefixLayout:
        """The layout as one micro-batch (M = 1 view): the micro-batches' prefix slots side by
        side, each row pointing at its own micro-batch's."""
        m, g = self.lengths_MG.shape
        micro_B = jnp.arange(self.group_B.shape[0]) % m  # row i is in micro-batch i % M
        return dataclasses.replace(
            self, tokens_MGP=self.tokens_MGP.reshape(m * g, -1),
            positions_MGP=self.positions_MGP.reshape(m * g, -1),
            lengths_MG=self.lengths_MG.reshape(m * g), group_B=self.group_B + g * micro_B)


@dataclasses.dataclass(frozen=True)
class PlannedBatch:
    batch: Batch  # the padded host batch, rows reordered
    layout: PrefixLayout  # numpy
    computed_tokens: int  # prefix + suffix tokens whose activations the step computes
    batch_tokens: int  # real tokens of the batch
    order: np.ndarray  # row i of `batch` is row order[i] of the batch planned


def _group_prefix(tokens_RT, positions_RT, cap: int) -> int:
    """Length of the prefix all rows share (tokens and positions), at most `cap`."""
    if cap <= 0:
        return 0
    same_T = np.all(tokens_RT[:, :cap] == tokens_RT[:1, :cap], axis=0)
    same_T &= np.all(positions_RT[:, :cap] == positions_RT[:1, :cap], axis=0)
    return cap if same_T.all() else int(np.argmin(same_T))


def _bucket(n: int, min_len: int) -> int:
    return padded_shape(1, max(n, 1), row_multiple=1, min_len=min_len)[1]


def _assign(groups: list[np.ndarray], micro_batches: int,
            rows_each: int) -> list[list[np.ndarray]]:
    """Groups into micro-batches of `rows_each` rows, largest first into the one with most room;
    a group larger than that room is split, the rest going back in line (each part then computes
    the prompt once). Never fails while the groups hold at most `micro_batches * rows_each` rows."""
    parts = [[] for _ in range(micro_batches)]
    room = [rows_each] * micro_batches
    queue = sorted(groups, key=len, reverse=True)
    while queue:
        rows = queue.pop(0)
        m = int(np.argmax(room))
        parts[m].append(rows[: room[m]])
        if len(rows) > room[m]:
            queue = sorted([*queue, rows[room[m]:]], key=len, reverse=True)
        room[m] -= len(parts[m][-1])
    return parts


def plan_prefix_layout(batch: Batch, micro_batches: int, *,
                       min_len: int = 16) -> PlannedBatch | None:
    """Lay out a padded host batch for the shared-prefix step, or None where the plain layout is
    the one to use: packed rows (several segments per row), rows not right-padded, groups that
    share less than `MIN_SAVED_FRACTION` of the tokens (a group that does not fit in the rest
    of a micro-batch is split, each part computing the prompt once). Lengths are rounded up to
    `padded_shape`'s buckets (from `min_len`), prefix slots to a power of two, so the step
    compiles for few shapes."""
    tokens, pos = np.asarray(batch.tokens), np.asarray(batch.positions)
    seg, mask = np.asarray(batch.segment_ids), np.asarray(batch.loss_mask)
    gid = np.asarray(batch.group_ids)
    b, t = tokens.shape
    lengths_B = (seg > 0).sum(axis=1)
    right_padded = np.array_equal(seg > 0, np.arange(t)[None, :] < lengths_B[:, None])
    if np.any(seg > 1) or not right_padded or b % micro_batches:
        return None
    valid_B = lengths_B > 0
    first_loss_B = np.where(mask.any(axis=1), np.argmax(mask > 0, axis=1), lengths_B)
    groups = [np.flatnonzero(valid_B & (gid == g)) for g in np.unique(gid[valid_B])]
    prefix_B = np.zeros(b, np.int64)
    for rows in groups:
        cap = int(first_loss_B[rows].min()) - 1  # the last shared token stays in the suffix
        prefix_B[rows] = _group_prefix(tokens[rows], pos[rows], cap)
    rows_each = b // micro_batches
    parts = _assign(groups, micro_batches, rows_each)
    saved = sum((len(rows) - 1) * int(prefix_B[rows[0]]) for part in parts for rows in part)
    batch_tokens = int(lengths_B.sum())
    if saved < MIN_SAVED_FRACTION * max(batch_tokens, 1):
        return None
    padding = list(np.flatnonzero(~valid_B))
    order = np.zeros(b, np.int64)  # new row m + M * j <- old row order[m + M * j]
    slot_B = np.zeros(b, np.int32)
    for m, part in enumerate(parts):
        rows = list(np.concatenate(part)) if part else []
        rows += [padding.pop() for _ in range(rows_each - len(rows))]
        order[m::micro_batches] = rows
        slots = np.concatenate([np.full(len(r), k) for k, r in enumerate(part)] or [[]])
        slot_B[m::micro_batches][: len(slots)] = slots
    g = 1 << max(max(len(part) for part in parts) - 1, 0).bit_length()
    p = _bucket(int(prefix_B.max()), min_len)
    s = _bucket(int((lengths_B - prefix_B)[valid_B].max(initial=1)), min_len)
    tokens_MGP = np.zeros((micro_batches, g, p), np.int32)
    positions_MGP = np.broadcast_to(np.arange(p, dtype=np.int32), (micro_batches, g, p)).copy()
    lengths_MG = np.zeros((micro_batches, g), np.int32)
    for m, part in enumerate(parts):
        for k, rows in enumerate(part):
            n = int(prefix_B[rows[0]])
            tokens_MGP[m, k, :n], positions_MGP[m, k, :n] = tokens[rows[0], :n], pos[rows[0], :n]
            lengths_MG[m, k] = n
    start_B, len_B = prefix_B[order], lengths_B[order]
    idx_BS = start_B[:, None] + np.arange(s)[None, :]
    idx_BS = np.where(idx_BS < len_B[:, None], idx_BS, -1).astype(np.int32)
    inv_BT = np.arange(t)[None, :] - start_B[:, None]
    inv_BT = np.where((inv_BT >= 0) & (np.arange(t)[None, :] < len_B[:, None]), inv_BT, -1)
    layout = PrefixLayout(tokens_MGP, positions_MGP, lengths_MG, slot_B, idx_BS,
                          inv_BT.astype(np.int32))
    reordered = jax.tree.map(lambda x: np.asarray(x)[order], batch)
    computed = int(lengths_MG.sum() + (len_B - start_B)[len_B > 0].sum())
    return PlannedBatch(reordered, layout, computed, batch_tokens, order)


def micro_layouts(layout: PrefixLayout, m: int) -> PrefixLayout:
    """The layout split into its M micro-batches along a new leading axis (rows m, m + M, ...,
    as `jaxrl.train.step` splits the batch)."""

    def rows(x):
        return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)

    return dataclasses.replace(layout, group_B=rows(layout.group_B),
                               suffix_index_BS=rows(layout.suffix_index_BS),
                               inverse_BT=rows(layout.inverse_BT))
