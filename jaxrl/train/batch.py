"""The trainer's batch: one frozen pytree, built and checked on the host by `make_batch`.

One row = one sequence (prompt + completion, right padded). Shape suffixes: B rows, T tokens.

Alignment: `tokens[b, t]` is predicted by the model's output at position t-1, so every per-token
log-probability here (`behaviour_logprobs`, `proximal_logprobs`, `ref_logprobs`, and what the
trainer computes) is indexed by the position of the token it scores: `logp[b, t] = log
pi(tokens[b, t] | tokens[b, :t])`. Position 0 is never scored: `loss_mask[:, 0]` must be 0 and
logprob arrays hold 0 there. A generator that returns one logprob per generated token writes it at
that token's position.

Fields:
  tokens        int32 [B, T]  prompt + completion, right padded (pad id is irrelevant)
  positions     int32 [B, T]  RoPE positions (0..len-1 for an unpacked row)
  segment_ids   int32 [B, T]  1 on real tokens, 0 on padding; an all-zero row is a padding row
  loss_mask     f32   [B, T]  1 on completion tokens that carry loss, else 0
  rewards       f32   [B]     scalar reward of each sequence (before the overlong penalty)
  group_ids     int32 [B]     rows with equal id are samples of one prompt; ids in [0, B)
  behaviour_logprobs  f32 [B, T] | None  generator's mu (needed by the off-policy corrections)
  versions      int32 [B, T] | None  policy version that produced each token (in-flight mode)
  proximal_logprobs   f32 [B, T] | None  pi_old, the trainer's logprobs before this update;
                                          filled by `Trainer.prepare` when a correction needs it
  ref_logprobs  f32 [B, T] | None  reference policy; filled by `Trainer.prepare` when kl_coef > 0
  sample_weights f32 [B] | None  per-row loss weight in [0, 1] (stale data kept with a
                                 down-weight, `pipeline.stale_policy="downweight"`); None = all 1
  routed_experts int8/int16 [B, T, Ls, K] | None  a mixture of experts: the experts the
                 generator's Ls sparse layers chose for each token (indexed by the token routed,
                 not the one it predicts); -1 where none was recorded (padding, the last sampled
                 token). The trainer replays them with `train.routing_replay` and measures
                 `moe/routing_mismatch` against them either way.
"""

from __future__ import annotations

import dataclasses

import jax
import numpy as np

from jaxrl.rounding import round_up

_OPTIONAL_BT = ("behaviour_logprobs", "versions", "proximal_logprobs", "ref_logprobs")


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Batch:
    tokens: jax.Array
    positions: jax.Array
    segment_ids: jax.Array
    loss_mask: jax.Array
    rewards: jax.Array
    group_ids: jax.Array
    behaviour_logprobs: jax.Array | None = None
    versions: jax.Array | None = None
    proximal_logprobs: jax.Array | None = None
    ref_logprobs: jax.Array | None = None
    sample_weights: jax.Array | None = None
    routed_experts: jax.Array | None = None

    @property
    def shape(self) -> tuple[int, int]:
        return tuple(self.tokens.shape)

    def replace(self, **kw) -> Batch:
        return dataclasses.replace(self, **kw)


class BatchError(ValueError):
    pass


def _arr(name, x, dtype, shape):
    a = np.asarray(x)
    if a.shape != shape:
        raise BatchError(f"batch.{name} has shape {a.shape}; expected {shape} (B, T from tokens)")
    if np.issubdtype(dtype, np.integer) and not np.issubdtype(a.dtype, np.integer):
        raise BatchError(f"batch.{name} must be integer; got dtype {a.dtype}")
    return a.astype(dtype)


def make_batch(
    tokens,
    loss_mask,
    rewards,
    group_ids,
    *,
    positions=None,
    segment_ids=None,
    behaviour_logprobs=None,
    versions=None,
    proximal_logprobs=None,
    ref_logprobs=None,
    sample_weights=None,
    routed_experts=None,
) -> Batch:
    """Build a host-side `Batch` (numpy), checking shapes, dtypes and the alignment rules.

    `positions` default to 0..T-1; `segment_ids` default to 1 where `tokens` is not followed only
    by padding -- pass them explicitly when rows are padded (right padding: 1 up to each row's
    length, 0 after).
    """
    tokens = np.asarray(tokens)
    if tokens.ndim != 2 or not np.issubdtype(tokens.dtype, np.integer):
        raise BatchError(
            f"batch.tokens must be an int [B, T] array; got {tokens.dtype}{tokens.shape}"
        )
    bt = tokens.shape
    b = bt[0]
    if positions is None:
        positions = np.broadcast_to(np.arange(bt[1], dtype=np.int32), bt)
    if segment_ids is None:
        segment_ids = np.ones(bt, np.int32)
    fields = dict(
        tokens=tokens.astype(np.int32),
        positions=_arr("positions", positions, np.int32, bt),
        segment_ids=_arr("segment_ids", segment_ids, np.int32, bt),
        loss_mask=_arr("loss_mask", loss_mask, np.float32, bt),
        rewards=_arr("rewards", rewards, np.float32, (b,)),
        group_ids=_arr("group_ids", group_ids, np.int32, (b,)),
    )
    opt = dict(
        behaviour_logprobs=behaviour_logprobs,
        versions=versions,
        proximal_logprobs=proximal_logprobs,
        ref_logprobs=ref_logprobs,
    )
    for name, x in opt.items():
        if x is not None:
            fields[name] = _arr(name, x, np.int32 if name == "versions" else np.float32, bt)
    if sample_weights is not None:
        fields["sample_weights"] = _arr("sample_weights", sample_weights, np.float32, (b,))
    if routed_experts is not None:
        ex = np.asarray(routed_experts)
        if ex.ndim != 4 or ex.shape[:2] != bt or not np.issubdtype(ex.dtype, np.integer):
            raise BatchError(f"batch.routed_experts must be an int [B, T, Ls, K] array with "
                             f"B, T = {bt}; got {ex.dtype}{ex.shape}")
        fields["routed_experts"] = ex
    out = Batch(**fields)
    check_batch(out)
    return out


def check_batch(batch: Batch) -> None:
    """Host-side checks of the rules in the module docstring (raises `BatchError`)."""
    mask = np.asarray(batch.loss_mask)
    seg = np.asarray(batch.segment_ids)
    if np.any(mask[:, 0] != 0):
        raise BatchError("batch.loss_mask[:, 0] must be 0: position 0 has no prediction")
    if np.any((mask != 0) & (seg == 0)):
        raise BatchError("batch.loss_mask is 1 on a padding position (segment_ids == 0)")
    if not np.all((mask == 0) | (mask == 1)):
        raise BatchError("batch.loss_mask must hold only 0 and 1")
    gid = np.asarray(batch.group_ids)
    b = mask.shape[0]
    if gid.size and (gid.min() < 0 or gid.max() >= b):
        raise BatchError(f"batch.group_ids must lie in [0, B={b}); got [{gid.min()}, {gid.max()}]")
    for name in ("rewards", "sample_weights", *_OPTIONAL_BT):
        x = getattr(batch, name)
        if x is not None and not np.all(np.isfinite(np.asarray(x))):
            raise BatchError(f"batch.{name} holds NaN or Inf")
    w = batch.sample_weights
    if w is not None and np.any((np.asarray(w) < 0) | (np.asarray(w) > 1)):
        raise BatchError(f"batch.sample_weights must lie in [0, 1]; got {np.asarray(w)}")


def padded_shape(b: int, t: int, *, row_multiple: int, min_len: int, max_len: int | None = None):
    """The fixed shape a [b, t] batch is padded to, so the step compiles for few shapes only:
    rows up to a multiple of `row_multiple`; length up to the next bucket, capped at `max_len`.
    Up to `4 * min_len` the buckets are `min_len * 2^k` and `min_len * 3 * 2^(k-1)` (16, 24, 32,
    48, 64 for 16); above it, eight per octave (72, 80, ..., 128, then 144, 160, ..., 256, ...):
    padding costs at most an eighth of a long batch's compute, for at most eight compiled
    lengths per doubling. (A 104-token GRPO batch padded to 128 took 1.33x as long per step as
    at 104: docs/benchmarks.md.)"""
    rows = round_up(b, row_multiple)
    length = min_len
    while length < min(t, 4 * min_len):
        # the 3/2 step between two powers of two, when it is whole and large enough
        between = length * 3 // 2
        length = between if between >= t and length % 2 == 0 else length * 2
    if t > length:
        octave = 1 << ((t - 1).bit_length() - 1)  # the power of two just below t
        length = round_up(t, max(octave // 8, 1))
    if max_len is not None:
        if t > max_len:
            raise BatchError(f"batch length {t} exceeds the trainer's max length {max_len}")
        length = min(length, max_len)
    return rows, length


def pad_batch(batch: Batch, rows: int, length: int) -> Batch:
    """Pad a host batch with padding rows / positions (segment 0, mask 0) to [rows, length].

    Padding rows join group 0 but, having no real token, enter no group statistic."""
    b, t = batch.shape
    if rows < b or length < t:
        raise BatchError(f"cannot pad a [{b}, {t}] batch down to [{rows}, {length}]")

    def pad(x, value=0):
        if x is None:
            return None
        x = np.asarray(x)
        widths = [(0, rows - b)] + ([(0, length - t)] if x.ndim >= 2 else [])
        return np.pad(x, widths + [(0, 0)] * (x.ndim - len(widths)), constant_values=value)

    out = {f.name: pad(getattr(batch, f.name), -1 if f.name == "routed_experts" else 0)
           for f in dataclasses.fields(batch)}
    if length > t:  # keep positions increasing past the end (harmless, masked anyway)
        out["positions"][:, t:] = np.arange(t, length, dtype=np.int32)
    return Batch(**out)


def completion_lengths(loss_mask_BT):
    """Completion length in tokens per row (= loss tokens), used by the overlong penalty."""
    return loss_mask_BT.sum(axis=-1)
