"""Sampling parameters and the per-slot sampler (temperature, top-k, top-p, greedy).

Every slot of a decode batch carries its own parameters, so one jitted step serves requests with
different settings. The transformed distribution follows `transformers`' logits processors in
their order: temperature, then top-k, then top-p (nucleus). The log-probability returned for a
sampled token is its log-probability under that transformed distribution — the behaviour
log-probability used for off-policy correction. Greedy rows (temperature 0) return the
log-probability under the untransformed model distribution (a point mass would always give 0).

Randomness: a sample's token `t` uses `fold_in(fold_in(key(seed), sample_index), t)`, so results
depend neither on the slot a request lands in nor on what else is in the batch.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.models import lowp_dots
from jaxrl_kernels import cpu_top_k

_KEY_IMPL = "threefry2x32"
_NEG_INF = -jnp.inf


@dataclasses.dataclass(frozen=True)
class SamplingParams:
    """How to sample completions for one prompt.

    `temperature=0` is greedy; `top_k=0` and `top_p=1` disable those filters. `n` samples share the
    prompt's prefill. `stop_token_ids` end a sample (the stop token is kept in the completion, with
    its log-probability); the engine's EOS ids stop as well unless `ignore_eos`, which generates
    on through EOS (to `max_tokens` or a stop id; what follows an EOS is whatever the model makes
    of it -- for fixed-length benchmarks). `min_tokens` bans the stop ids (EOS included, unless
    ignored) from the first `min_tokens` tokens: their logits are -inf there, as `transformers`'
    `MinNewTokensLengthLogitsProcessor` does, and the returned log-probabilities are under that
    masked distribution (the one actually sampled from).
    """

    max_tokens: int = 16
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    n: int = 1
    seed: int = 0
    stop_token_ids: tuple[int, ...] = ()
    min_tokens: int = 0
    ignore_eos: bool = False

    def __post_init__(self):
        object.__setattr__(self, "stop_token_ids", tuple(int(t) for t in self.stop_token_ids))
        if not isinstance(self.n, int) or self.n < 1:
            raise ValueError(f"SamplingParams.n must be an integer >= 1, got {self.n!r}")
        if not isinstance(self.max_tokens, int) or self.max_tokens < 1:
            raise ValueError(
                f"SamplingParams.max_tokens must be an integer >= 1, got {self.max_tokens!r}"
            )
        if not self.temperature >= 0:
            raise ValueError(
                f"SamplingParams.temperature must be >= 0 (0 = greedy), got {self.temperature!r}"
            )
        if not isinstance(self.top_k, int) or self.top_k < 0:
            raise ValueError(
                f"SamplingParams.top_k must be an integer >= 0 (0 = off), got {self.top_k!r}"
            )
        if not 0 < self.top_p <= 1:
            raise ValueError(
                f"SamplingParams.top_p must be in (0, 1] (1 = off), got {self.top_p!r}"
            )
        if not isinstance(self.min_tokens, int) or not 0 <= self.min_tokens <= self.max_tokens:
            raise ValueError(
                f"SamplingParams.min_tokens must be an integer in [0, max_tokens="
                f"{self.max_tokens}], got {self.min_tokens!r}"
            )
        if not isinstance(self.ignore_eos, bool):
            raise ValueError(
                f"SamplingParams.ignore_eos must be True or False, got {self.ignore_eos!r}"
            )
        if not isinstance(self.seed, int) or not 0 <= self.seed < 2**64:
            raise ValueError(
                f"SamplingParams.seed must be an integer in [0, 2**64), got {self.seed!r}"
            )

    @property
    def greedy(self) -> bool:
        return self.temperature == 0


def seed_key_data(seed: int) -> np.ndarray:
    """Raw threefry key data for `seed` (equal to `jax.random.key(seed)` for 32-bit seeds)."""
    return np.array([(seed >> 32) & 0xFFFFFFFF, seed & 0xFFFFFFFF], dtype=np.uint32)


def sample_key(key_data_2, sample_index, token_index):
    """The key for token `token_index` of sample `sample_index` of a request."""
    key = jax.random.wrap_key_data(key_data_2, impl=_KEY_IMPL)
    return jax.random.fold_in(jax.random.fold_in(key, sample_index), token_index)


def _threshold(desc_BK, x_BV, top_k_B, top_p_B):
    """The smallest kept value per row, from the row's largest values in descending order.

    Top-k keeps values >= the k-th largest; top-p then keeps the entries whose preceding mass
    (in descending order, renormalised over the top-k set) is below `top_p`. Also returns whether
    `desc_BK` held enough values to decide (always true when it holds the whole row).
    """
    kk = desc_BK.shape[-1]
    k_B = jnp.where(top_k_B > 0, jnp.minimum(top_k_B, kk), kk)
    kth_B1 = jnp.take_along_axis(desc_BK, (k_B - 1)[:, None], axis=-1)
    desc_BK = jnp.where(desc_BK >= kth_B1, desc_BK, _NEG_INF)
    # Normalise over the top-k set, or over the whole row when top-k is off.
    lse_B1 = jnp.where((top_k_B > 0)[:, None],
                       jax.nn.logsumexp(desc_BK, axis=-1, keepdims=True),
                       jax.nn.logsumexp(x_BV, axis=-1, keepdims=True))
    probs_BK = jnp.exp(desc_BK - lse_B1)
    before_BK = jnp.cumsum(probs_BK, axis=-1) - probs_BK  # mass strictly ahead of each entry
    keep_BK = (before_BK < top_p_B[:, None]) | (top_p_B[:, None] >= 1.0)
    keep_BK = keep_BK & (desc_BK > _NEG_INF)
    num_keep_B = jnp.maximum(jnp.sum(keep_BK, axis=-1), 1)
    threshold_B1 = jnp.take_along_axis(desc_BK, (num_keep_B - 1)[:, None], axis=-1)
    decided_B = (((top_k_B > 0) & (top_k_B <= kk)) | (kk == x_BV.shape[-1])
                 | ((top_k_B == 0) & (jnp.sum(probs_BK, axis=-1) >= top_p_B)))
    return threshold_B1, decided_B


def transform_logits(logits_BV, temperature_B, top_k_B, top_p_B, *, candidates: int = 64):
    """Logits of the distribution actually sampled from; filtered-out entries are -inf.

    Greedy rows (temperature <= 0) are returned unscaled and unfiltered. Top-k keeps every entry
    >= the k-th largest value (ties kept, as `transformers` does); top-p then keeps the smallest
    prefix, by descending probability, whose mass reaches `top_p`.

    Sorting a whole vocabulary row is slow on CPU, so the filters first look at the row's
    `candidates` largest values (`lax.top_k`); only when a row's kept set may extend beyond them
    (top_k > candidates, or a nucleus with more mass outside) is the full row sorted.
    """
    v = logits_BV.shape[-1]
    sampling_B = temperature_B > 0
    scale_B = jnp.where(sampling_B, temperature_B, 1.0)
    x_BV = logits_BV.astype(jnp.float32) / scale_B[:, None]
    filter_B = sampling_B & ((top_k_B > 0) | (top_p_B < 1.0))

    def apply(threshold_B1, x_BV):
        out_BV = jnp.where(x_BV >= threshold_B1, x_BV, _NEG_INF)
        return jnp.where(filter_B[:, None], out_BV, x_BV)

    def full_sort(x_BV):
        return apply(_threshold(-jnp.sort(-x_BV, axis=-1), x_BV, top_k_B, top_p_B)[0], x_BV)

    def filtered(x_BV):
        top_BK, _ = top_candidates(x_BV, min(candidates, v))
        threshold_B1, decided_B = _threshold(top_BK, x_BV, top_k_B, top_p_B)
        return jax.lax.cond(jnp.any(filter_B & ~decided_B), full_sort,
                            functools.partial(apply, threshold_B1), x_BV)

    return jax.lax.cond(jnp.any(filter_B), filtered, lambda x: x, x_BV)


def _first_above(probs_BN, threshold_B):
    """Per row: the first index whose inclusive cumulative sum exceeds `threshold`, and the mass
    before it. Rounding can push the threshold past the total: then the last entry with mass."""
    cdf_BN = jnp.cumsum(probs_BN, axis=-1)
    idx_B = jnp.sum(cdf_BN <= threshold_B[:, None], axis=-1)
    iota_N = jnp.arange(probs_BN.shape[-1], dtype=jnp.int32)
    last_B = jnp.max(jnp.where(probs_BN > 0, iota_N[None, :], 0), axis=-1)
    idx_B = jnp.minimum(idx_B, last_B)
    before_B = jnp.take_along_axis(cdf_BN - probs_BN, idx_B[:, None], axis=-1)[:, 0]
    return idx_B.astype(jnp.int32), before_B


def _inverse_cdf(weights_BV, u_B, block: int = 128):
    """Inverse-CDF sampling: the entry where the cumulative weight first exceeds `u * total`
    (weights need not be normalised).

    Two levels (block sums, then within the chosen block) keep the scans short on CPU.
    """
    b, v = weights_BV.shape
    n = -(-v // block)
    blocks_BNW = jnp.pad(weights_BV, ((0, 0), (0, n * block - v))).reshape(b, n, block)
    sums_BN = jnp.sum(blocks_BNW, axis=-1)
    threshold_B = u_B * jnp.sum(sums_BN, axis=-1)
    blk_B, before_B = _first_above(sums_BN, threshold_B)
    within_BW = jnp.take_along_axis(blocks_BNW, blk_B[:, None, None], axis=1)[:, 0]
    idx_B, _ = _first_above(within_BW, threshold_B - before_B)
    return blk_B * block + idx_B


def _argmax(x_BV):
    """First index of the row maximum (two plain reductions: faster than argmax on CPU)."""
    max_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    iota_V = jnp.arange(x_BV.shape[-1], dtype=jnp.int32)
    return jnp.min(jnp.where(x_BV == max_B1, iota_V[None, :], x_BV.shape[-1]), axis=-1)


def _top_k(x_BN, k: int):
    """`lax.top_k`; in the step of an engine on one CPU device (`lowp_dots.cpu_kernels()`) the
    multi-threaded `jaxrl_kernels.cpu_top_k` when it is built: XLA:CPU sorts each row on one
    thread."""
    if (lowp_dots.cpu_kernels() and x_BN.ndim == 2 and x_BN.dtype == jnp.float32
            and cpu_top_k.available()):
        return cpu_top_k.top_k(x_BN, k)
    return jax.lax.top_k(x_BN, k)


def top_candidates(x_BV, k: int, block: int | None = None, *, vocab_major: bool = False):
    """The `k` largest values of each row in descending order, and their indices.

    Equal to `lax.top_k` in values; faster on CPU for a wide row: the row is cut into blocks of
    `block` entries, and only the `k` blocks with the largest maxima are searched (every one of
    the row's `k` largest values lies in one of them: at most `k - 1` blocks have a larger
    maximum than the `k`-th block's). Among equal values the indices chosen may differ.

    The two searches cover `v / block` block maxima and `k * block` pooled entries, so by
    default a CPU engine's step (`lowp_dots.active()`) takes `block` as the power of two at or
    above `sqrt(v / k)`: 32 for a 32,000-entry vocabulary and k = 64 (XLA:CPU's two TopK calls
    0.96 ms a step at batch 32, 1.20 with 128-entry blocks), 64 for 151,936 entries. Elsewhere
    it is 128 (not measured on GPU / TPU, so their lowering is kept). `vocab_major`: `x` is
    given `[V, B]` and read in place (the results are still `[B, k]`).
    """
    b, v = x_BV.shape[::-1] if vocab_major else x_BV.shape
    if block is None:
        block = 1 << max(0, math.ceil(math.log2(math.sqrt(v / k)))) if lowp_dots.active() else 128
    n = -(-v // block)
    if n < 2 * k or block < 16:  # too few blocks, or too small, for the two levels to pay
        return _top_k(x_BV.T if vocab_major else x_BV, k)
    pad = n * block - v
    if vocab_major:
        blocks_NWB = jnp.pad(x_BV, ((0, pad), (0, 0)), constant_values=_NEG_INF).reshape(
            n, block, b)
        _, blk_BK = _top_k(jnp.max(blocks_NWB, axis=1).T, k)
        pool_BKW = blocks_NWB[blk_BK[:, :, None], jnp.arange(block)[None, None, :],
                              jnp.arange(b)[:, None, None]]
        pool_BP = pool_BKW.reshape(b, k * block)
    else:
        blocks_BNW = jnp.pad(x_BV, ((0, 0), (0, pad)), constant_values=_NEG_INF).reshape(
            b, n, block)
        _, blk_BK = _top_k(jnp.max(blocks_BNW, axis=-1), k)
        pool_BP = jnp.take_along_axis(blocks_BNW, blk_BK[:, :, None], axis=1).reshape(
            b, k * block)
    vals_BK, pos_BK = _top_k(pool_BP, k)
    idx_BK = jnp.take_along_axis(blk_BK, pos_BK // block, axis=1) * block + pos_BK % block
    # XLA:CPU keeps a `top_k` as its fast TopK call only while every user slices the first `k`
    # entries; a caller's `vals[:, :1]` merged into that slice turns it into a full sort of the
    # pool (~60 ms at [32, 8192] instead of ~1). The barrier keeps callers' slices apart.
    return jax.lax.optimization_barrier((vals_BK, idx_BK))


def _full_row(logits_BV, u_B, temperature_B, top_k_B, top_p_B):
    """Sample from the whole transformed row (any settings)."""
    x_BV = transform_logits(logits_BV, temperature_B, top_k_B, top_p_B)
    max_B1 = jnp.max(x_BV, axis=-1, keepdims=True)
    weights_BV = jnp.exp(x_BV - max_B1)  # filtered entries: exp(-inf) = 0
    lse_B = max_B1[:, 0] + jnp.log(jnp.sum(weights_BV, axis=-1))
    sampled_B = _inverse_cdf(weights_BV, u_B)
    tokens_B = jnp.where(temperature_B <= 0, _argmax(logits_BV), sampled_B)
    return tokens_B, jnp.take_along_axis(x_BV, tokens_B[:, None], axis=-1)[:, 0] - lse_B


def _from_candidates(logits_BV, u_B, temperature_B, top_BK, idx_BK, threshold_B1,
                     vocab_axis: int = -1):
    """Sample from the candidates alone: every kept entry is one of them (see `sample_tokens`).

    The draw is the one `_full_row` makes: the kept entry where the mass, in vocabulary order,
    first exceeds `u * total`. The mass ahead of each candidate comes from a `[K, K]` comparison
    of indices (K is small), so the candidates need no sorting into vocabulary order.
    """
    greedy_B = temperature_B <= 0
    weights_BK = jnp.where(top_BK >= threshold_B1, jnp.exp(top_BK - top_BK[:, :1]), 0.0)
    total_B = jnp.sum(weights_BK, axis=-1)
    ahead_BKK = idx_BK[:, None, :] < idx_BK[:, :, None]  # [b, j, i]: i before j in the vocabulary
    before_BK = jnp.sum(jnp.where(ahead_BKK, weights_BK[:, None, :], 0.0), axis=-1)
    # the last kept entry (in vocabulary order) whose mass ahead is within the threshold
    hit_BK = (weights_BK > 0) & (before_BK <= (u_B * total_B)[:, None])
    v = logits_BV.shape[vocab_axis]
    sampled_B = jnp.max(jnp.where(hit_BK, idx_BK, -1), axis=-1)
    pick_BK = idx_BK == sampled_B[:, None]
    logp_B = (jnp.sum(jnp.where(pick_BK, top_BK, 0.0), axis=-1)
              - top_BK[:, 0] - jnp.log(total_B))
    # greedy rows: the first index of the maximum, with the untransformed model log-probability
    argmax_B = jnp.min(jnp.where(top_BK == top_BK[:, :1], idx_BK, v), axis=-1)
    lse_B = jax.lax.cond(jnp.any(greedy_B), lambda x: jax.nn.logsumexp(x, axis=vocab_axis),
                         lambda x: jnp.zeros(top_BK.shape[:1], x.dtype),
                         logits_BV.astype(jnp.float32))
    greedy_logp_B = top_BK[:, 0] - lse_B
    return jnp.where(greedy_B, argmax_B, sampled_B), jnp.where(greedy_B, greedy_logp_B, logp_B)


def sample_tokens(logits_BV, keys_B, temperature_B, top_k_B, top_p_B, *, candidates: int = 64,
                  vocab_major: bool = False):
    """Sample one token per row; returns `(tokens_B int32, logprobs_B f32)`.

    `keys_B` is a batch of typed PRNG keys (one per row). Sampling is by inverse CDF (in
    vocabulary order) with one uniform number per row, so a row's token depends only on its own
    logits and key. When every row is greedy or top-k filtered (top_k < `candidates`) and no
    entry outside the row's `candidates` largest can be kept, only those candidates are
    touched after they are found (a fast path: the same tokens, without passes over the whole
    row); otherwise the whole transformed row is sampled.

    `vocab_major`: the logits are given `[V, B]` (a CPU engine's tied lm head makes them so,
    `lowp_dots.table_logits`): the candidates are found reading them in place, and only a batch
    that samples whole rows transposes them. The candidates are the largest logits, divided by
    the temperature afterwards: dividing by a positive number keeps their order.
    """
    axis = 0 if vocab_major else -1
    v = logits_BV.shape[axis]
    kk = min(candidates, v)
    u_B = jax.vmap(lambda k: jax.random.uniform(k, (), jnp.float32))(keys_B)
    sampling_B = temperature_B > 0

    def full_row():  # in a branch: a vocab-major batch is transposed only when it gets here
        rows_BV = logits_BV.T if vocab_major else logits_BV
        return _full_row(rows_BV, u_B, temperature_B, top_k_B, top_p_B)

    def candidates_or_full_row():
        top_BK, idx_BK = top_candidates(logits_BV.astype(jnp.float32), kk,
                                        vocab_major=vocab_major)
        top_BK = top_BK / jnp.where(sampling_B, temperature_B, 1.0)[:, None]
        threshold_B1, _ = _threshold(top_BK, top_BK, jnp.where(sampling_B, top_k_B, kk),
                                     top_p_B)
        # nothing outside the candidates is kept: the kept set ends above their smallest value
        # (for a greedy row: the maximum does), or the candidates are the whole row
        last_B = jnp.min(top_BK, axis=-1)
        inside_B = jnp.where(sampling_B, threshold_B1[:, 0], jnp.max(top_BK, axis=-1)) > last_B
        return jax.lax.cond(
            (kk == v) | jnp.all(inside_B),
            lambda: _from_candidates(logits_BV, u_B, temperature_B, top_BK, idx_BK,
                                     threshold_B1, axis),
            full_row)

    eligible = jnp.any(sampling_B) & jnp.all(~sampling_B | ((top_k_B > 0) & (top_k_B <= kk)))
    return jax.lax.cond(eligible, candidates_or_full_row, full_row)


def ban_stop_ids(logits_BV, stop_ids_BS, ban_B, *, vocab_major: bool = False):
    """`logits_BV` with each banned row's stop ids (-1 padded) set to -inf (`min_tokens`);
    `vocab_major`: given and returned `[V, B]`."""
    v = logits_BV.shape[0 if vocab_major else -1]
    rows_BS = jnp.broadcast_to(jnp.arange(ban_B.shape[0])[:, None], stop_ids_BS.shape)
    cols_BS = jnp.where(ban_B[:, None] & (stop_ids_BS >= 0), stop_ids_BS, v)  # v: dropped
    if vocab_major:
        return logits_BV.at[cols_BS, rows_BS].set(_NEG_INF, mode="drop")
    return logits_BV.at[rows_BS, cols_BS].set(_NEG_INF, mode="drop")


def stop_id_array(stop_ids: Sequence[int], width: int) -> np.ndarray:
    """Stop ids padded with -1 to a fixed width."""
    out = np.full((width,), -1, np.int32)
    out[: len(stop_ids)] = np.asarray(list(stop_ids), np.int32)
    return out
