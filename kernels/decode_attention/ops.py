"""``decode_attention``: one query token per sequence over a contiguous KV cache.

Jitted wrapper with static frozen ``BlockSizes`` and an ``interpret`` flag; split-K partials from
the TPU (kernel.py) or GPU (kernel_gpu.py) body, combined here. Inference only (no gradient).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl_kernels._util import (
    cdiv,
    check_softcap,
    check_window,
    next_pow2,
    resolve_backend,
    round_up,
    window_span,
)
from jaxrl_kernels.decode_attention.kernel import decode_tpu
from jaxrl_kernels.decode_attention.kernel_gpu import decode_gpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """block_k: kv tokens per step (TPU: also the DMA unit). num_splits: split-K factor (None:
    enough programs to fill the chip). num_warps / num_stages: GPU (Triton) only."""

    block_k: int | None = None
    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def resolve(self, backend: str, batch: int, num_kv_heads: int, seq_len: int) -> BlockSizes:
        if backend == "tpu":
            block_k = max(8, min(self.block_k or 512, round_up(seq_len, 8)))
            programs, target = batch, 2  # megacore: two TensorCores on v4 / v5p
        else:
            block_k = max(16, min(next_pow2(self.block_k or 64), next_pow2(seq_len)))
            programs, target = batch * num_kv_heads, 264  # ~2 waves on an H100 (132 SMs)
        nb = cdiv(seq_len, block_k)
        splits = self.num_splits or cdiv(target, programs)
        return BlockSizes(
            block_k=block_k,
            num_splits=max(1, min(splits, nb)),
            num_warps=self.num_warps or 4,
            num_stages=self.num_stages or 3,
        )

    def fit_window(self, seq_len: int, window: int | None) -> BlockSizes:
        """At most one split per block a window can touch (a resolved ``BlockSizes``)."""
        if window is None:
            return self
        span = window_span(cdiv(seq_len, self.block_k), window, self.block_k)
        return dataclasses.replace(self, num_splits=min(self.num_splits, span))


def combine_partials(acc, m, l, *, base2: bool):
    """Merge split-K partials. acc [..., K, G, D], m/l [..., K, G] -> [..., G, D] (f32)."""
    m_max = jnp.max(m, axis=-2, keepdims=True)
    w = jnp.exp2(m - m_max) if base2 else jnp.exp(m - m_max)
    l_tot = jnp.sum(w * l, axis=-2)
    o = jnp.sum(w[..., None] * acc, axis=-3)
    return o / jnp.where(l_tot == 0.0, 1.0, l_tot)[..., None]


def check_decode_args(q, k, v, lengths):
    B, Hq, D = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k/v must be [B, S, Hkv, D] matching q {q.shape}; got {k.shape}, {v.shape}"
        )
    if Hq % k.shape[2]:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={k.shape[2]}")
    if lengths.shape != (B,):
        raise ValueError(f"lengths must be [B] = ({B},); got {lengths.shape}")


def run_split_k(q, Hkv, sm_scale, backend, tpu_call, gpu_call):
    """Fold q [B, Hq, D] by kv head, call the body, combine the partials -> [B, Hq, D]."""
    B, Hq, D = q.shape
    G = Hq // Hkv
    q4 = q.reshape(B, Hkv, G, D)
    if backend == "tpu":
        acc, m, l = tpu_call(q4)  # [B, K, Hkv, G, D], [B, K, Hkv, G, 1]
        o = combine_partials(
            acc.transpose(0, 2, 1, 3, 4),
            m[..., 0].transpose(0, 2, 1, 3),
            l[..., 0].transpose(0, 2, 1, 3),
            base2=False,
        )
    else:
        Gp = max(16, next_pow2(G))
        q4 = jnp.pad(q4, ((0, 0), (0, 0), (0, Gp - G), (0, 0)))
        acc, m, l = gpu_call(q4)  # [B, Hkv, K, Gp, D], [B, Hkv, K, Gp]
        o = combine_partials(acc, m, l, base2=True)[:, :, :G]
    return o.reshape(B, Hq, D).astype(q.dtype)


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_sizes", "interpret", "backend", "window", "softcap"),
)
def decode_attention(
    q,
    k_cache,
    v_cache,
    lengths,
    *,
    sm_scale=None,
    block_sizes=None,
    interpret=False,
    backend=None,
    window=None,
    softcap=None,
):
    """q [B, Hq, D], k_cache/v_cache [B, S, Hkv, D], lengths int32 [B] -> [B, Hq, D] (q.dtype).

    Row b attends to cache positions [0, lengths[b]) (0 gives zeros); positions beyond are never
    read. Query head n uses kv head n // (Hq // Hkv). ``interpret`` / ``backend`` as in
    ``jaxrl_kernels.flash_attention``. ``window`` (static int): a sliding window; the query sits
    at position lengths[b] - 1 and sees positions p with lengths[b] - 1 - window < p <=
    lengths[b] - 1 (transformers' ``sliding_window_overlay``: kv_idx > q_idx - window). Only the
    cache blocks that hold them are read: the cost is O(window), whatever the length. Cache slot
    i must hold position i (a contiguous cache, not a ring buffer). ``softcap`` (static positive
    float): logit soft-capping, scaled scores s -> softcap * tanh(s / softcap) (Gemma 2).
    """
    check_decode_args(q, k_cache, v_cache, lengths)
    window = check_window(window)
    softcap = check_softcap(softcap)
    B, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    backend, interpret = resolve_backend(backend, interpret)
    bs = (block_sizes or BlockSizes()).resolve(backend, B, Hkv, S).fit_window(S, window)
    scale = float(D**-0.5 if sm_scale is None else sm_scale)
    lengths = jnp.minimum(lengths.astype(jnp.int32), S)
    return run_split_k(
        q,
        Hkv,
        scale,
        backend,
        lambda q4: decode_tpu(
            q4,
            k_cache,
            v_cache,
            lengths,
            sm_scale=scale,
            block_k=bs.block_k,
            num_splits=bs.num_splits,
            interpret=interpret,
            window=window,
            softcap=softcap,
        ),
        lambda q4: decode_gpu(
            q4,
            k_cache,
            v_cache,
            lengths,
            sm_scale=scale,
            block_k=bs.block_k,
            num_splits=bs.num_splits,
            num_warps=bs.num_warps,
            num_stages=bs.num_stages,
            interpret=interpret,
            window=window,
            softcap=softcap,
        ),
    )
