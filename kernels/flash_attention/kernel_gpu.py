"""Flash attention forward, GPU body on Pallas' Triton lowering.

Why Triton and not Mosaic GPU: (1) the Triton lowering runs unchanged in Pallas' generic
interpreter, so this body is tested on CPU (interpret=True) in CI, while a Mosaic GPU body (TMA,
wgmma, barriers, warp specialisation) can only be checked on a Hopper/Blackwell GPU, which this
project's CI lacks; (2) it runs on Ampere as well as Hopper; (3) it exists in both pinned jax lines
(0.10.2 and 0.11.x). Trade-off: jax 0.11 deprecates the Pallas Triton backend in favour of Mosaic
GPU, and on H100/H200 a Triton flash forward usually reaches ~60-75% of cuDNN. A Mosaic GPU body
(modelled on jax/experimental/pallas/ops/gpu/attention_mgpu.py) is the planned follow-up once a GPU
is available to validate it; ops.py dispatches by backend, so it would replace this file without
API changes.

Rows r = t * G + g fold the G query heads of one kv head (GQA), as in kernel.py, but each
program reads its [bt, G, D] slab straight from q's own [B, T, Hq, D] layout and k/v from
[B, S, Hkv, D]: no transposes, which would cost up to half the kernel time at T = 1k. Grid
(num_q_blocks, B, Hkv); each program streams its kv range [lo, hi) from the per-block ``bounds``
(causality + segment ids; blocks outside are never loaded) in two loops: [lo, mid) without a mask,
[mid, hi) with it. Softmax runs in base 2 (scale folded with log2 e) as Triton's exp is exp2 anyway.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl

from jaxrl_kernels._util import (
    BIG_LSE,
    LN2,
    LOG2E,
    MASK_VALUE,
    capped_scores_and_slope,
    out_struct,
    scaled_scores,
)

_NT = (((1,), (1,)), ((), ()))
_NN = (((1,), (0,)), ((), ()))
_TN = (((0,), (0,)), ((), ()))  # a.T @ b


def _flash_fwd_kernel(
    bounds_ref,  # [4] int32: lo, mid, hi, unused
    q_ref,  # [bt, G, D]: bt tokens x the G query heads of one kv head
    k_ref,  # [Sp, D]
    v_ref,  # [Sp, D]
    q_seg_ref,  # [bq] int32
    kv_seg_ref,  # [Sp] int32
    o_ref,  # [bt, G, D]
    lse_ref,  # [bq] f32
    *,
    sm_scale: float,
    causal: bool,
    use_segments: bool,
    window: int | None,
    kv_len: int | None,
    group: int,
    block_k: int,
    softcap: float | None = None,
):
    i = pl.program_id(0)
    bt, G, D = q_ref.shape
    bq = bt * G  # folded rows, r = t * G + g
    bk = block_k
    lo, mid, hi = bounds_ref[0], bounds_ref[1], bounds_ref[2]
    q = q_ref[...].reshape(bq, D)
    q_seg = q_seg_ref[...] if use_segments else None
    rows_t = (i * bq + jnp.arange(bq, dtype=jnp.int32)) // group

    def make_step(masked: bool):
        def step(j, carry):
            acc, m, l = carry
            kv_slice = pl.ds(pl.multiple_of(j * bk, bk), bk)
            k = k_ref[kv_slice, :]
            s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
            s = scaled_scores(s, sm_scale, softcap, LOG2E)  # base 2, soft-capped before the mask
            mask = None
            if masked:
                cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
                mask = jnp.ones((bq, bk), dtype=bool)
                if causal:
                    mask = mask & (cols[None, :] <= rows_t[:, None])
                if window is not None:
                    mask = mask & (cols[None, :] > rows_t[:, None] - window)
                if kv_len is not None:
                    mask = mask & (cols[None, :] < kv_len)
                if use_segments:
                    mask = mask & (q_seg[:, None] == kv_seg_ref[kv_slice][None, :])
                s = jnp.where(mask, s, MASK_VALUE)
            m_new = jnp.maximum(m, jnp.max(s, axis=1))
            p = jnp.exp2(s - m_new[:, None])
            if masked:
                p = jnp.where(mask, p, 0.0)
            alpha = jnp.exp2(m - m_new)
            l = alpha * l + jnp.sum(p, axis=1)
            v = v_ref[kv_slice, :]
            pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
            return acc * alpha[:, None] + pv, m_new, l

        return step

    carry = (
        jnp.zeros((bq, D), jnp.float32),
        jnp.full((bq,), MASK_VALUE, jnp.float32),
        jnp.zeros((bq,), jnp.float32),
    )
    split = jnp.maximum(lo, jnp.minimum(mid, hi))
    if window is not None:  # blocks starting at or before the last row's t - window: masked
        t_last = (i * bq + bq - 1) // group
        full = jnp.clip((jnp.maximum(t_last - window + 1, 0) + bk - 1) // bk, lo, split)
        carry = lax.fori_loop(lo, full, make_step(True), carry)
        lo = full
    carry = lax.fori_loop(lo, split, make_step(False), carry)
    acc, m, l = lax.fori_loop(split, hi, make_step(True), carry)
    empty = l == 0.0
    safe_l = jnp.where(empty, 1.0, l)
    o_ref[...] = (acc / safe_l[:, None]).astype(o_ref.dtype).reshape(bt, G, D)
    lse_ref[...] = jnp.where(empty, BIG_LSE, (m + jnp.log2(safe_l)) * LN2)


def flash_fwd_gpu(
    bounds,
    qf,
    kf,
    vf,
    q_seg,
    kv_seg,
    *,
    sm_scale,
    causal,
    use_segments,
    kv_len,
    group,
    block_q,
    block_k,
    num_warps,
    num_stages,
    interpret,
    window=None,
    softcap=None,
):
    """q5 [B, Tp, Hkv, G, D] (q's own layout, reshaped), k/v [B, Sp, Hkv, D] (their own layout),
    q_seg [B, Tp * G] (folded rows), kv_seg [B, Sp], bounds [B, nq, 4]. No transposes: each
    program reads a [bt, G, D] slab of q and folds it to bt * G rows in registers.

    Returns o [B, Tp, Hkv, G, D] (q5.dtype) and lse [B, Hkv, Tp * G] f32.
    """
    from jax.experimental.pallas import triton as pltriton

    B, Tp, Hkv, G, D = qf.shape
    Sp = kf.shape[1]
    bt = block_q // G
    nq, Rp = Tp // bt, Tp * G
    kernel = functools.partial(
        _flash_fwd_kernel,
        sm_scale=sm_scale,
        causal=causal,
        use_segments=use_segments,
        window=window,
        kv_len=kv_len,
        group=group,
        block_k=block_k,
        softcap=softcap,
    )
    q_spec = pl.BlockSpec((None, bt, None, G, D), lambda i, b, h: (b, i, h, 0, 0))
    kv_spec = pl.BlockSpec((None, Sp, None, D), lambda i, b, h: (b, 0, h, 0))
    return pl.pallas_call(
        kernel,
        grid=(nq, B, Hkv),
        in_specs=[
            pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)),
            q_spec,
            kv_spec,
            kv_spec,
            pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
        ],
        out_specs=[q_spec, pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))],
        out_shape=[
            out_struct(qf.shape, qf.dtype, qf),
            out_struct((B, Hkv, Rp), jnp.float32, qf),
        ],
        compiler_params=pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages),
        interpret=interpret,
        name="jaxrl_flash_fwd_gpu",
    )(bounds, qf, kf, vf, q_seg, kv_seg)


def _bwd_mask(rows, cols, q_seg, kv_seg, *, causal, window, kv_len, group):
    mask = jnp.ones((rows.shape[0], cols.shape[0]), dtype=bool)
    if causal:
        mask = mask & (cols[None, :] <= (rows // group)[:, None])
    if window is not None:
        mask = mask & (cols[None, :] > (rows // group)[:, None] - window)
    if kv_len is not None:
        mask = mask & (cols[None, :] < kv_len)
    if q_seg is not None:
        mask = mask & (q_seg[:, None] == kv_seg[None, :])
    return mask


def _flash_bwd_dkv_kernel(
    qbounds_ref,  # [4] int32: q block range [qlo, qhi) that sees this kv block
    q_ref,  # [Tp, G, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    do_ref,  # [Tp, G, D]
    lse_ref,  # [Rp] f32 (natural log)
    delta_ref,  # [Rp] f32: rowsum(o * do)
    q_seg_ref,  # [Rp] int32
    kv_seg_ref,  # [bk] int32
    dk_ref,  # [bk, D]
    dv_ref,  # [bk, D]
    *,
    sm_scale: float,
    causal: bool,
    use_segments: bool,
    window: int | None,
    kv_len: int | None,
    block_q: int,
    softcap: float | None = None,
):
    j = pl.program_id(0)
    _, G, D = q_ref.shape
    bk = k_ref.shape[0]
    bq, bt = block_q, block_q // G
    k, v = k_ref[...], v_ref[...]
    cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
    kv_seg = kv_seg_ref[...] if use_segments else None

    def body(i, carry):
        dk, dv = carry
        q = q_ref[pl.ds(pl.multiple_of(i * bt, bt), bt), :, :].reshape(bq, D)
        do = do_ref[pl.ds(pl.multiple_of(i * bt, bt), bt), :, :].reshape(bq, D)
        row_slice = pl.ds(pl.multiple_of(i * bq, bq), bq)
        rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
        q_seg = q_seg_ref[row_slice] if use_segments else None
        mask = _bwd_mask(
            rows, cols, q_seg, kv_seg, causal=causal, window=window, kv_len=kv_len, group=G
        )
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
        s, slope = capped_scores_and_slope(s, sm_scale, softcap)
        p = jnp.where(mask, jnp.exp(s - lse_ref[row_slice][:, None]), 0.0)
        dv = dv + lax.dot_general(p.astype(do.dtype), do, _TN, preferred_element_type=jnp.float32)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[row_slice][:, None]) * sm_scale
        if slope is not None:  # through the cap: d/dx c tanh(x / c) = 1 - tanh(x / c)^2
            ds = ds * slope
        dk = dk + lax.dot_general(ds.astype(q.dtype), q, _TN, preferred_element_type=jnp.float32)
        return dk, dv

    zeros = jnp.zeros((bk, D), jnp.float32)
    dk, dv = lax.fori_loop(qbounds_ref[0], qbounds_ref[1], body, (zeros, zeros))
    dk_ref[...] = dk.astype(dk_ref.dtype)
    dv_ref[...] = dv.astype(dv_ref.dtype)


def _flash_bwd_dq_kernel(
    bounds_ref,  # [4] int32: kv block range [lo, mid, hi) of this q block (forward table)
    q_ref,  # [bt, G, D]
    k_ref,  # [Sp, D]
    v_ref,  # [Sp, D]
    do_ref,  # [bt, G, D]
    lse_ref,  # [bq]
    delta_ref,  # [bq]
    q_seg_ref,  # [bq]
    kv_seg_ref,  # [Sp]
    dq_ref,  # [bt, G, D]
    *,
    sm_scale: float,
    causal: bool,
    use_segments: bool,
    window: int | None,
    kv_len: int | None,
    block_k: int,
    softcap: float | None = None,
):
    i = pl.program_id(0)
    bt, G, D = q_ref.shape
    bq, bk = bt * G, block_k
    q = q_ref[...].reshape(bq, D)
    do = do_ref[...].reshape(bq, D)
    lse, delta = lse_ref[...], delta_ref[...]
    rows = i * bq + jnp.arange(bq, dtype=jnp.int32)
    q_seg = q_seg_ref[...] if use_segments else None

    def body(j, dq):
        kv_slice = pl.ds(pl.multiple_of(j * bk, bk), bk)
        k, v = k_ref[kv_slice, :], v_ref[kv_slice, :]
        cols = j * bk + jnp.arange(bk, dtype=jnp.int32)
        kv_seg = kv_seg_ref[kv_slice] if use_segments else None
        mask = _bwd_mask(
            rows, cols, q_seg, kv_seg, causal=causal, window=window, kv_len=kv_len, group=G
        )
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
        s, slope = capped_scores_and_slope(s, sm_scale, softcap)
        p = jnp.where(mask, jnp.exp(s - lse[:, None]), 0.0)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta[:, None]) * sm_scale
        if slope is not None:
            ds = ds * slope
        return dq + lax.dot_general(ds.astype(k.dtype), k, _NN, preferred_element_type=jnp.float32)

    dq = lax.fori_loop(bounds_ref[0], bounds_ref[2], body, jnp.zeros((bq, D), jnp.float32))
    dq_ref[...] = dq.astype(dq_ref.dtype).reshape(bt, G, D)


def flash_bwd_gpu(
    bounds,
    qbounds,
    q5,
    k,
    v,
    do5,
    lse,
    delta,
    q_seg,
    kv_seg,
    *,
    sm_scale,
    causal,
    use_segments,
    kv_len,
    block_q,
    block_k,
    num_warps,
    num_stages,
    interpret,
    window=None,
    softcap=None,
):
    """Backward on the GPU: a dk/dv kernel (grid over kv blocks, loop over the q blocks that see
    each) and a dq kernel (grid over q blocks, loop over their kv range). Layouts as the forward's;
    lse / delta / q_seg are [B, Hkv, Rp] / [B, Hkv, Rp] / [B, Rp] in folded rows, qbounds
    [B, nk, 4]. Returns dq5 [B, Tp, Hkv, G, D], dk, dv [B, Sp, Hkv, D]."""
    from jax.experimental.pallas import triton as pltriton

    B, Tp, Hkv, G, D = q5.shape
    Sp = k.shape[1]
    bt, Rp = block_q // G, Tp * G
    nq, nk = Tp // bt, Sp // block_k
    params = pltriton.CompilerParams(num_warps=num_warps, num_stages=num_stages)
    flags = dict(
        sm_scale=sm_scale,
        causal=causal,
        use_segments=use_segments,
        window=window,
        kv_len=kv_len,
        softcap=softcap,
    )
    full_q = pl.BlockSpec((None, Tp, None, G, D), lambda j, b, h: (b, 0, h, 0, 0))
    kv_blk = pl.BlockSpec((None, block_k, None, D), lambda j, b, h: (b, j, h, 0))
    rows_all = pl.BlockSpec((None, None, Rp), lambda j, b, h: (b, h, 0))
    dk, dv = pl.pallas_call(
        functools.partial(_flash_bwd_dkv_kernel, block_q=block_q, **flags),
        grid=(nk, B, Hkv),
        in_specs=[
            pl.BlockSpec((None, None, 4), lambda j, b, h: (b, j, 0)),
            full_q,
            kv_blk,
            kv_blk,
            full_q,
            rows_all,
            rows_all,
            pl.BlockSpec((None, Rp), lambda j, b, h: (b, 0)),
            pl.BlockSpec((None, block_k), lambda j, b, h: (b, j)),
        ],
        out_specs=[kv_blk, kv_blk],
        out_shape=[out_struct(k.shape, k.dtype, k), out_struct(v.shape, v.dtype, v)],
        compiler_params=params,
        interpret=interpret,
        name="jaxrl_flash_bwd_dkv_gpu",
    )(qbounds, q5, k, v, do5, lse, delta, q_seg, kv_seg)
    q_blk = pl.BlockSpec((None, bt, None, G, D), lambda i, b, h: (b, i, h, 0, 0))
    full_kv = pl.BlockSpec((None, Sp, None, D), lambda i, b, h: (b, 0, h, 0))
    rows_blk = pl.BlockSpec((None, None, block_q), lambda i, b, h: (b, h, i))
    dq = pl.pallas_call(
        functools.partial(_flash_bwd_dq_kernel, block_k=block_k, **flags),
        grid=(nq, B, Hkv),
        in_specs=[
            pl.BlockSpec((None, None, 4), lambda i, b, h: (b, i, 0)),
            q_blk,
            full_kv,
            full_kv,
            q_blk,
            rows_blk,
            rows_blk,
            pl.BlockSpec((None, block_q), lambda i, b, h: (b, i)),
            pl.BlockSpec((None, Sp), lambda i, b, h: (b, 0)),
        ],
        out_specs=q_blk,
        out_shape=out_struct(q5.shape, q5.dtype, q5),
        compiler_params=params,
        interpret=interpret,
        name="jaxrl_flash_bwd_dq_gpu",
    )(bounds, q5, k, v, do5, lse, delta, q_seg, kv_seg)
    return dq, dk, dv
