"""Decode attention, GPU body on Pallas' Triton lowering (see flash_attention/kernel_gpu.py for why
Triton rather than Mosaic GPU).

Grid (B, Hkv, num_splits): split-K (FlashDecoding) so that small batches still fill the SMs. A
program owns one kv head of one row and one split of the cache; it loops over blocks of ``block_k``
tokens up to min(split end, length), so only the valid prefix is read, with the G query heads of
that kv head folded into the rows of one matmul (padded to >= 16 rows for the tensor cores). Loads
are masked, so the last block may run past the cache end. Writes unnormalised partials (acc, m, l)
for the combine in ops.py.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_kernels._util import LOG2E, MASK_VALUE, out_struct, scaled_scores, window_span

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))


def online_softmax_block(q, k, v, valid, carry, sm_scale, softcap=None):
    """One kv block of the base-2 online softmax. q [Gp, D]; k/v [bk, D]; valid [bk] bool.
    ``softcap``: the scaled scores soft-capped (before the mask)."""
    acc, m, l = carry
    s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
    s = scaled_scores(s, sm_scale, softcap, LOG2E)
    s = jnp.where(valid[None, :], s, MASK_VALUE)
    m_new = jnp.maximum(m, jnp.max(s, axis=1))
    p = jnp.where(valid[None, :], jnp.exp2(s - m_new[:, None]), 0.0)
    alpha = jnp.exp2(m - m_new)
    pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
    return acc * alpha[:, None] + pv, m_new, alpha * l + jnp.sum(p, axis=1)


def init_carry(Gp, D):
    return (
        jnp.zeros((Gp, D), jnp.float32),
        jnp.full((Gp,), MASK_VALUE, jnp.float32),
        jnp.zeros((Gp,), jnp.float32),
    )


def _decode_kernel(
    length_ref,
    q_ref,
    k_ref,
    v_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    sm_scale: float,
    block_k: int,
    split_len: int,
    window: int | None = None,
    softcap: float | None = None,
):
    """length_ref [1]; q_ref [Gp, D]; k_ref/v_ref [Sb, D]; o_ref [Gp, D]; m_ref/l_ref [Gp].

    With a ``window`` the splits start at the block holding position length - window, and
    positions before it are neither loaded nor mixed in."""
    from jax.experimental.pallas import triton as pltriton

    s = pl.program_id(2)
    Gp, D = q_ref.shape
    length = length_ref[0]
    start = s * split_len
    if window is not None:
        start = jnp.maximum(length - window, 0) // block_k * block_k + start
    end = jnp.minimum(start + split_len, length)
    q = q_ref[...]

    def body(j, carry):
        off = start + j * block_k
        idx = off + jnp.arange(block_k, dtype=jnp.int32)
        valid = idx < end
        if window is not None:
            valid = valid & (idx >= length - window)
        sl = pl.ds(pl.multiple_of(off, block_k), block_k)
        mask2 = jnp.broadcast_to(valid[:, None], (block_k, D))
        k = pltriton.load(k_ref.at[sl, :], mask=mask2, other=0.0)
        v = pltriton.load(v_ref.at[sl, :], mask=mask2, other=0.0)
        return online_softmax_block(q, k, v, valid, carry, sm_scale, softcap)

    n = (jnp.maximum(end - start, 0) + block_k - 1) // block_k
    acc, m, l = lax.fori_loop(0, n, body, init_carry(Gp, D))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def decode_gpu(
    q4,
    k_cache,
    v_cache,
    lengths,
    *,
    sm_scale,
    block_k,
    num_splits,
    num_warps,
    num_stages,
    interpret,
    window=None,
    softcap=None,
):
    """q4 [B, Hkv, Gp, D] (Gp >= 16, power of 2), caches [B, S, Hkv, D] -> partials in base 2.
    With a ``window``, the splits cover only the blocks it can touch."""
    from jax.experimental.pallas import triton as pltriton

    B, Hkv, Gp, D = q4.shape
    S = k_cache.shape[1]
    nb = -(-S // block_k)
    split_len = -(-window_span(nb, window, block_k) // num_splits) * block_k
    kernel = functools.partial(
        _decode_kernel,
        sm_scale=sm_scale,
        block_k=block_k,
        split_len=split_len,
        window=window,
        softcap=softcap,
    )
    kv_spec = pl.BlockSpec((None, nb * block_k, None, D), lambda b, h, s: (b, 0, h, 0))
    o_spec = pl.BlockSpec((None, None, None, Gp, D), lambda b, h, s: (b, h, s, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, Gp), lambda b, h, s: (b, h, s, 0))
    return pl.pallas_call(
        kernel,
        grid=(B, Hkv, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, None, Gp, D), lambda b, h, s: (b, h, 0, 0)),
            kv_spec,
            kv_spec,
        ],
        out_specs=[o_spec, ml_spec, ml_spec],
        out_shape=[
            out_struct((B, Hkv, num_splits, Gp, D), jnp.float32, q4),
            out_struct((B, Hkv, num_splits, Gp), jnp.float32, q4),
            out_struct((B, Hkv, num_splits, Gp), jnp.float32, q4),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxrl_decode_attention_gpu",
    )(lengths, q4, k_cache, v_cache)
