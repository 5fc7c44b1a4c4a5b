"""Paged decode attention, TPU (Mosaic) body: the decode body of
kernels/decode_attention/kernel.py with a page-table index map.

``lengths`` and the flattened page table are scalar-prefetched into SMEM; the kv BlockSpec's index
map looks up the physical page of logical page (split * pages_per_split + j), clamped to the row's
last valid page, so the pipeline DMAs exactly the pages that hold valid tokens (page-table entries
past a row's length are never read). One grid step = one page of [page_size, Hkv, D].
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_kernels._util import window_span
from jaxrl_kernels.decode_attention.kernel import (
    decode_kernel_body,
    first_block,
    partial_out_specs_and_shapes,
)


def _paged_kernel(
    lengths_ref, page_table_ref, *refs, sm_scale, blocks_per_split, window, softcap=None
):
    del page_table_ref  # used by the index maps only
    decode_kernel_body(
        lengths_ref,
        *refs,
        sm_scale=sm_scale,
        blocks_per_split=blocks_per_split,
        window=window,
        softcap=softcap,
    )


def paged_decode_tpu(
    q4,
    k_pages,
    v_pages,
    lengths,
    page_table,
    *,
    sm_scale,
    num_splits,
    interpret,
    window=None,
    softcap=None,
):
    """q4 [B, Hkv, G, D]; pages [N, page_size, Hkv, D]; page_table [B, P] -> split-K partials.

    With a ``window``, the splits cover only the pages from the one holding position
    length - window on; table entries before it are never read."""
    B, Hkv, G, D = q4.shape
    page_size = k_pages.shape[1]
    P = page_table.shape[1]
    pps = -(-window_span(P, window, page_size) // num_splits)

    def page_index(b, s, j, lengths_ref, pt_ref):
        last = jnp.maximum(lax.div(lengths_ref[b] + page_size - 1, page_size) - 1, 0)
        logical = s * pps + j
        if window is not None:
            logical = first_block(lengths_ref[b], window, page_size) + logical
        logical = jnp.minimum(jnp.minimum(logical, last), P - 1)
        return (pt_ref[b * P + logical], 0, 0, 0)

    kv_spec = pl.BlockSpec((None, page_size, Hkv, D), page_index)
    q_spec = pl.BlockSpec((None, Hkv, G, D), lambda b, s, j, lr, pr: (b, 0, 0, 0))
    out_specs, out_shape, scratch = partial_out_specs_and_shapes(
        B, num_splits, Hkv, G, D, lambda b, s, j, lr, pr: (b, s, 0, 0, 0), q4
    )
    kernel = functools.partial(
        _paged_kernel, sm_scale=sm_scale, blocks_per_split=pps, window=window, softcap=softcap
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=2,
            grid=(B, num_splits, pps),
            in_specs=[q_spec, kv_spec, kv_spec],
            out_specs=out_specs,
            scratch_shapes=scratch,
        ),
        out_shape=out_shape,
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="jaxrl_paged_decode_attention_tpu",
    )(lengths, page_table.reshape(-1), q4, k_pages, v_pages)
