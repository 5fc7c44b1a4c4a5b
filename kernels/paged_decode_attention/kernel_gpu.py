"""Paged decode attention, GPU body on Pallas' Triton lowering (why Triton: see
kernels/flash_attention/kernel_gpu.py).

Grid (B, Hkv, num_splits). A program walks the logical pages of its split up to the row's length,
loads each page's [page_size, D] slab of its kv head through the page table (pointer arithmetic on
the whole page pool, no gather copy), and runs the same base-2 online softmax as the contiguous
decode body. page_size must be a power of two >= 16 (a Triton dot needs >= 16 per dimension).
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_kernels._util import out_struct, window_span
from jaxrl_kernels.decode_attention.kernel_gpu import init_carry, online_softmax_block


def _paged_kernel(
    length_ref,
    page_table_ref,
    q_ref,
    k_pages_ref,
    v_pages_ref,
    o_ref,
    m_ref,
    l_ref,
    *,
    sm_scale: float,
    pages_per_split: int,
    window: int | None = None,
    softcap: float | None = None,
):
    """length_ref [1]; page_table_ref [P]; q_ref [Gp, D]; pages [N, ps, Hkv, D]; o_ref [Gp, D].

    With a ``window`` the splits start at the page holding position length - window; earlier
    pages (and their table entries) are never read."""
    from jax.experimental.pallas import triton as pltriton

    h, s = pl.program_id(1), pl.program_id(2)
    Gp, D = q_ref.shape
    ps = k_pages_ref.shape[1]
    length = length_ref[0]
    first = s * pages_per_split
    if window is not None:
        first = jnp.maximum(length - window, 0) // ps + first
    last = jnp.minimum(first + pages_per_split, (length + ps - 1) // ps)
    q = q_ref[...]

    def body(p, carry):
        page = page_table_ref[p]
        valid = p * ps + jnp.arange(ps, dtype=jnp.int32) < length
        if window is not None:
            valid = valid & (p * ps + jnp.arange(ps, dtype=jnp.int32) >= length - window)
        mask2 = jnp.broadcast_to(valid[:, None], (ps, D))
        k = pltriton.load(k_pages_ref.at[page, :, h, :], mask=mask2, other=0.0)
        v = pltriton.load(v_pages_ref.at[page, :, h, :], mask=mask2, other=0.0)
        return online_softmax_block(q, k, v, valid, carry, sm_scale, softcap)

    acc, m, l = lax.fori_loop(first, jnp.maximum(last, first), body, init_carry(Gp, D))
    o_ref[...] = acc
    m_ref[...] = m
    l_ref[...] = l


def paged_decode_gpu(
    q4,
    k_pages,
    v_pages,
    lengths,
    page_table,
    *,
    sm_scale,
    num_splits,
    num_warps,
    num_stages,
    interpret,
    window=None,
    softcap=None,
):
    """q4 [B, Hkv, Gp, D]; pages [N, page_size, Hkv, D]; page_table [B, P] -> base-2 partials.
    With a ``window``, the splits cover only the pages it can touch."""
    from jax.experimental.pallas import triton as pltriton

    B, Hkv, Gp, D = q4.shape
    P = page_table.shape[1]
    pps = -(-window_span(P, window, k_pages.shape[1]) // num_splits)
    kernel = functools.partial(
        _paged_kernel, sm_scale=sm_scale, pages_per_split=pps, window=window, softcap=softcap
    )
    pool_spec = pl.BlockSpec(k_pages.shape, lambda b, h, s: (0, 0, 0, 0))
    o_spec = pl.BlockSpec((None, None, None, Gp, D), lambda b, h, s: (b, h, s, 0, 0))
    ml_spec = pl.BlockSpec((None, None, None, Gp), lambda b, h, s: (b, h, s, 0))
    return pl.pallas_call(
        kernel,
        grid=(B, Hkv, num_splits),
        in_specs=[
            pl.BlockSpec((1,), lambda b, h, s: (b,)),
            pl.BlockSpec((None, P), lambda b, h, s: (b, 0)),
            pl.BlockSpec((None, None, Gp, D), lambda b, h, s: (b, h, 0, 0)),
            pool_spec,
            pool_spec,
        ],
        out_specs=[o_spec, ml_spec, ml_spec],
        out_shape=[
            out_struct((B, Hkv, num_splits, Gp, D), jnp.float32, q4),
            out_struct((B, Hkv, num_splits, Gp), jnp.float32, q4),
            out_struct((B, Hkv, num_splits, Gp), jnp.float32, q4),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxrl_paged_decode_attention_gpu",
    )(lengths, page_table, q4, k_pages, v_pages)
