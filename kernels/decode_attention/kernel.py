"""Decode attention (one query token per sequence), TPU (Mosaic) body.

One body serves the contiguous cache (this module) and the paged cache
(kernels/paged_decode_attention/kernel.py): only the index maps differ. Grid (B, num_splits,
blocks_per_split): split-K over the cache, each split keeps an online-softmax state in VMEM and
writes an unnormalised partial (acc, m, l) that ops.py combines. ``lengths`` is scalar-prefetched:
steps past a row's length do no compute, and their index map repeats the row's last valid block so
the pipeline issues no DMA — only the valid prefix of each row is read from HBM.

Each step loads a [block_k, Hkv, D] slab (all kv heads of block_k tokens, the cache's native
layout, no transpose) and serves all G query heads of each kv head from it (GQA folding).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_kernels._util import MASK_VALUE, out_struct, scaled_scores, window_span

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def decode_kernel_body(
    lengths_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    m_scr_ref,
    l_scr_ref,
    acc_scr_ref,
    *,
    sm_scale: float,
    blocks_per_split: int,
    window: int | None = None,
    softcap: float | None = None,
):
    """q_ref [Hkv, G, D]; k_ref/v_ref [bk, Hkv, D]; o_ref [Hkv, G, D] f32; m/l [Hkv, G, 1].

    With a ``window`` the splits cover the blocks from the one holding position length - window
    on (``first_block``), and positions before length - window are masked like those past it.
    ``softcap``: the scaled scores are soft-capped before the mask."""
    b, s, j = pl.program_id(0), pl.program_id(1), pl.program_id(2)
    bk, num_kv_heads = k_ref.shape[0], k_ref.shape[1]
    G = q_ref.shape[1]
    length = lengths_ref[b]
    block = s * blocks_per_split + j
    if window is not None:
        block = first_block(length, window, bk) + block
    start = block * bk

    @pl.when(j == 0)
    def _init():
        m_scr_ref[...] = jnp.full(m_scr_ref.shape, MASK_VALUE, jnp.float32)
        l_scr_ref[...] = jnp.zeros(l_scr_ref.shape, jnp.float32)
        acc_scr_ref[...] = jnp.zeros(acc_scr_ref.shape, jnp.float32)

    @pl.when(start < length)
    def _step():
        mask = start + lax.broadcasted_iota(jnp.int32, (G, bk), 1) < length
        # Rows past the length (or past the cache end, in an edge block) may hold garbage, even
        # NaN: zero them in v, since p == 0 does not protect a matmul from 0 * NaN.
        row_ok = start + lax.broadcasted_iota(jnp.int32, (bk, v_ref.shape[2]), 0) < length
        if window is not None:  # and so may rows before the window
            mask = mask & (start + lax.broadcasted_iota(jnp.int32, (G, bk), 1) >= length - window)
            row_pos = start + lax.broadcasted_iota(jnp.int32, (bk, v_ref.shape[2]), 0)
            row_ok = row_ok & (row_pos >= length - window)
        for h in range(num_kv_heads):
            q = q_ref[h]
            k = k_ref[:, h, :]
            v = jnp.where(row_ok, v_ref[:, h, :], 0).astype(v_ref.dtype)
            s_ = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
            s_ = scaled_scores(s_, sm_scale, softcap)
            s_ = jnp.where(mask, s_, MASK_VALUE)
            m_prev = m_scr_ref[h]
            m_new = jnp.maximum(m_prev, jnp.max(s_, axis=1, keepdims=True))
            p = jnp.where(mask, jnp.exp(s_ - m_new), 0.0)
            alpha = jnp.exp(m_prev - m_new)
            l_scr_ref[h] = alpha * l_scr_ref[h] + jnp.sum(p, axis=1, keepdims=True)
            pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
            acc_scr_ref[h] = alpha * acc_scr_ref[h] + pv
            m_scr_ref[h] = m_new

    @pl.when(j == pl.num_programs(2) - 1)
    def _finish():
        o_ref[...] = acc_scr_ref[...]
        m_ref[...] = m_scr_ref[...]
        l_ref[...] = l_scr_ref[...]


def first_block(length, window, block):
    """The block holding position max(length - window, 0): the first one a window reads."""
    # lax.div, not //: see decode_tpu's index map (the operands are >= 0).
    return lax.div(jnp.maximum(length - window, 0), block)


def partial_out_specs_and_shapes(B, num_splits, Hkv, G, D, index_map, like):
    o_spec = pl.BlockSpec((None, None, Hkv, G, D), index_map)
    ml_spec = pl.BlockSpec((None, None, Hkv, G, 1), index_map)
    shapes = [
        out_struct((B, num_splits, Hkv, G, D), jnp.float32, like),
        out_struct((B, num_splits, Hkv, G, 1), jnp.float32, like),
        out_struct((B, num_splits, Hkv, G, 1), jnp.float32, like),
    ]
    scratch = [
        pltpu.VMEM((Hkv, G, 1), jnp.float32),
        pltpu.VMEM((Hkv, G, 1), jnp.float32),
        pltpu.VMEM((Hkv, G, D), jnp.float32),
    ]
    return [o_spec, ml_spec, ml_spec], shapes, scratch


def decode_tpu(
    q4,
    k_cache,
    v_cache,
    lengths,
    *,
    sm_scale,
    block_k,
    num_splits,
    interpret,
    window=None,
    softcap=None,
):
    """q4 [B, Hkv, G, D], caches [B, S, Hkv, D], lengths [B] -> partials (acc, m, l) per split.

    With a ``window``, the splits cover only the blocks from ``first_block`` on: the grid and the
    DMAs are O(window), whatever the length."""
    B, Hkv, G, D = q4.shape
    S = k_cache.shape[1]
    nb = -(-S // block_k)
    bps = -(-window_span(nb, window, block_k) // num_splits)

    def kv_index(b, s, j, lengths_ref):
        # lax.div, not //: floor division of signed ints lowers through sign(), which Mosaic only
        # lowers with a known chip; lengths are >= 0, so truncation is the same.
        last = jnp.maximum(lax.div(lengths_ref[b] + block_k - 1, block_k) - 1, 0)
        block = s * bps + j
        if window is not None:
            block = first_block(lengths_ref[b], window, block_k) + block
        return (b, jnp.minimum(jnp.minimum(block, last), nb - 1), 0, 0)

    kv_spec = pl.BlockSpec((None, block_k, Hkv, D), kv_index)
    q_spec = pl.BlockSpec((None, Hkv, G, D), lambda b, s, j, lr: (b, 0, 0, 0))
    out_specs, out_shape, scratch = partial_out_specs_and_shapes(
        B, num_splits, Hkv, G, D, lambda b, s, j, lr: (b, s, 0, 0, 0), q4
    )
    kernel = functools.partial(
        decode_kernel_body,
        sm_scale=sm_scale,
        blocks_per_split=bps,
        window=window,
        softcap=softcap,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, num_splits, bps),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="jaxrl_decode_attention_tpu",
    )(lengths, q4, k_cache, v_cache)
