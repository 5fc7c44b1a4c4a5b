"""Flash attention forward, TPU (Mosaic) body.

Layout (prepared by ops.py): query heads that share a kv head are folded into the row axis, so the
kernel sees qf [B, Hkv, R, D] with row r = t * G + g (G = Hq // Hkv) and kv [B, Hkv, S, D]; one q
block of ``block_q`` rows multiplies each kv block once for all G heads (GQA folding).

Grid (B, Hkv, num_q_blocks, num_kv_steps). A scalar-prefetched table ``bounds`` [B * nq * 3] holds,
per (batch row, q block), the kv block range [lo, hi) that can contain a visible key (causality and
segment ids) and ``mid``: blocks in [lo, mid) are fully visible and skip the mask. Step j works on
kv block lo + j; steps past hi do nothing, and their index map repeats the previous block so the
pipeline issues no DMA for them: fully masked blocks cost neither compute nor HBM reads.
"""

from __future__ import annotations

import functools

import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import tpu as pltpu

from jaxrl_kernels._util import (
    BIG_LSE,
    MASK_VALUE,
    capped_scores_and_slope,
    out_struct,
    scaled_scores,
)

_NT = (((1,), (1,)), ((), ()))  # contract the last dims: a @ b.T
_NN = (((1,), (0,)), ((), ()))


def _flash_fwd_kernel(
    bounds_ref,  # SMEM [B * nq * 3] int32: lo, mid, hi per (b, q block)
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    q_seg_ref,  # [bq, 1] int32
    kv_seg_ref,  # [1, bk] int32
    o_ref,  # [bq, D]
    lse_ref,  # [bq, 1] f32
    m_scr_ref,  # VMEM [bq, 1] f32
    l_scr_ref,  # VMEM [bq, 1] f32
    acc_scr_ref,  # VMEM [bq, D] f32
    *,
    sm_scale: float,
    causal: bool,
    use_segments: bool,
    window: int | None,
    kv_len: int | None,
    group: int,
    num_q_blocks: int,
    softcap: float | None = None,
):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bq, bk = q_ref.shape[0], k_ref.shape[0]
    base = (b * num_q_blocks + i) * 3
    lo, mid, hi = bounds_ref[base], bounds_ref[base + 1], bounds_ref[base + 2]
    kv_block = lo + j

    @pl.when(j == 0)
    def _init():
        m_scr_ref[...] = jnp.full(m_scr_ref.shape, MASK_VALUE, jnp.float32)
        l_scr_ref[...] = jnp.zeros(l_scr_ref.shape, jnp.float32)
        acc_scr_ref[...] = jnp.zeros(acc_scr_ref.shape, jnp.float32)

    def step(masked: bool):
        q, k, v = q_ref[...], k_ref[...], v_ref[...]
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
        s = scaled_scores(s, sm_scale, softcap)  # soft-capped before the mask
        mask = None
        if masked:
            mask = jnp.ones((bq, bk), dtype=bool)
            cols = kv_block * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
            if causal:
                rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
                mask = mask & (cols * group <= rows)  # col <= row // G, without a division
            if window is not None:
                mask = mask & ((cols + window) * group > rows)  # col > row // G - window
            if kv_len is not None:
                mask = mask & (cols < kv_len)
            if use_segments:
                mask = mask & (q_seg_ref[...] == kv_seg_ref[...])
            s = jnp.where(mask, s, MASK_VALUE)
        m_prev = m_scr_ref[...]
        m_new = jnp.maximum(m_prev, jnp.max(s, axis=1, keepdims=True))
        p = jnp.exp(s - m_new)
        if masked:
            p = jnp.where(mask, p, 0.0)
        alpha = jnp.exp(m_prev - m_new)
        l_scr_ref[...] = alpha * l_scr_ref[...] + jnp.sum(p, axis=1, keepdims=True)
        pv = lax.dot_general(p.astype(v.dtype), v, _NN, preferred_element_type=jnp.float32)
        acc_scr_ref[...] = alpha * acc_scr_ref[...] + pv
        m_scr_ref[...] = m_new

    active = kv_block < hi
    if window is None:
        pl.when(active & (kv_block >= mid))(lambda: step(True))
        pl.when(active & (kv_block < mid))(lambda: step(False))
    else:  # a block starting at or before the last row's t - window needs the mask too
        early = (kv_block * bk + window) * group <= i * bq + bq - 1
        pl.when(active & ((kv_block >= mid) | early))(lambda: step(True))
        pl.when(active & (kv_block < mid) & ~early)(lambda: step(False))

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        l = l_scr_ref[...]
        empty = l == 0.0
        safe_l = jnp.where(empty, 1.0, l)
        o_ref[...] = (acc_scr_ref[...] / safe_l).astype(o_ref.dtype)
        lse_ref[...] = jnp.where(empty, BIG_LSE, m_scr_ref[...] + jnp.log(safe_l))


def flash_fwd_tpu(
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
    interpret,
    window=None,
    num_kv_steps=None,
    softcap=None,
):
    """qf [B, Hkv, Rp, D], kf/vf [B, Hkv, Sp, D], q_seg [B, Rp, 1], kv_seg [B, 1, Sp],
    bounds [B * nq * 3]. ``num_kv_steps``: kv grid steps, at least the widest [lo, hi) (None: all
    kv blocks; a window needs far fewer). ``softcap``: logits softcap * tanh(s / softcap).

    Returns o [B, Hkv, Rp, D] (qf.dtype) and lse [B, Hkv, Rp, 1] f32.
    """
    B, Hkv, Rp, D = qf.shape
    Sp = kf.shape[2]
    nq, nk = Rp // block_q, Sp // block_k

    def kv_block(b, i, j, bounds_ref):
        base = (b * nq + i) * 3
        lo, hi = bounds_ref[base], bounds_ref[base + 2]
        return jnp.minimum(lo + j, jnp.maximum(hi - 1, 0))

    q_spec = pl.BlockSpec((None, None, block_q, D), lambda b, h, i, j, br: (b, h, i, 0))
    kv_spec = pl.BlockSpec(
        (None, None, block_k, D), lambda b, h, i, j, br: (b, h, kv_block(b, i, j, br), 0)
    )
    q_seg_spec = pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, br: (b, i, 0))
    kv_seg_spec = pl.BlockSpec(
        (None, 1, block_k), lambda b, h, i, j, br: (b, 0, kv_block(b, i, j, br))
    )
    lse_spec = pl.BlockSpec((None, None, block_q, 1), lambda b, h, i, j, br: (b, h, i, 0))
    kernel = functools.partial(
        _flash_fwd_kernel,
        sm_scale=sm_scale,
        causal=causal,
        use_segments=use_segments,
        window=window,
        kv_len=kv_len,
        group=group,
        num_q_blocks=nq,
        softcap=softcap,
    )
    return pl.pallas_call(
        kernel,
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, nq, num_kv_steps or nk),
            in_specs=[q_spec, kv_spec, kv_spec, q_seg_spec, kv_seg_spec],
            out_specs=[q_spec, lse_spec],
            scratch_shapes=[
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, 1), jnp.float32),
                pltpu.VMEM((block_q, D), jnp.float32),
            ],
        ),
        out_shape=[
            out_struct(qf.shape, qf.dtype, qf),
            out_struct((B, Hkv, Rp, 1), jnp.float32, qf),
        ],
        compiler_params=pltpu.CompilerParams(
            dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
        ),
        interpret=interpret,
        name="jaxrl_flash_fwd_tpu",
    )(bounds, qf, kf, vf, q_seg, kv_seg)


def _bwd_mask_t(kv_block, q_block, bk, bq, *, causal, window, kv_len, group, q_seg_t, kv_seg_t):
    """Visibility in the transposed orientation [bk, bq] (kv rows, q columns), or None."""
    mask = None
    cols = kv_block * bk + lax.broadcasted_iota(jnp.int32, (bk, bq), 0)
    rows = q_block * bq + lax.broadcasted_iota(jnp.int32, (bk, bq), 1)
    if causal:
        mask = cols * group <= rows
    if window is not None:
        in_window = (cols + window) * group > rows
        mask = in_window if mask is None else mask & in_window
    if kv_len is not None:
        mask = (cols < kv_len) if mask is None else mask & (cols < kv_len)
    if q_seg_t is not None:
        same = kv_seg_t == q_seg_t  # [bk, 1] == [1, bq]
        mask = same if mask is None else mask & same
    return mask


def _flash_bwd_dkv_kernel(
    qbounds_ref,  # SMEM [B * nk * 2]: q block range [qlo, qhi) that sees each kv block
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    do_ref,  # [bq, D]
    lse_t_ref,  # [1, bq] f32
    delta_t_ref,  # [1, bq] f32
    q_seg_t_ref,  # [1, bq] int32
    kv_seg_t_ref,  # [bk, 1] int32
    dk_ref,  # [bk, D]
    dv_ref,  # [bk, D]
    dk_scr_ref,  # VMEM [bk, D] f32
    dv_scr_ref,  # VMEM [bk, D] f32
    *,
    sm_scale: float,
    causal: bool,
    use_segments: bool,
    window: int | None,
    kv_len: int | None,
    group: int,
    num_kv_blocks: int,
    softcap: float | None = None,
):
    """Scores are formed transposed (k q^T, [bk, bq]) so every matmul is NN or NT."""
    b, j, t = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bq, bk = q_ref.shape[0], k_ref.shape[0]
    base = (b * num_kv_blocks + j) * 2
    q_lo, q_hi = qbounds_ref[base], qbounds_ref[base + 1]
    q_block = q_lo + t

    @pl.when(t == 0)
    def _init():
        dk_scr_ref[...] = jnp.zeros(dk_scr_ref.shape, jnp.float32)
        dv_scr_ref[...] = jnp.zeros(dv_scr_ref.shape, jnp.float32)

    @pl.when(q_block < q_hi)
    def _step():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s_t = lax.dot_general(k, q, _NT, preferred_element_type=jnp.float32)
        s_t, slope_t = capped_scores_and_slope(s_t, sm_scale, softcap)
        p_t = jnp.exp(s_t - lse_t_ref[...])
        mask = _bwd_mask_t(
            j,
            q_block,
            bk,
            bq,
            causal=causal,
            window=window,
            kv_len=kv_len,
            group=group,
            q_seg_t=q_seg_t_ref[...] if use_segments else None,
            kv_seg_t=kv_seg_t_ref[...] if use_segments else None,
        )
        if mask is not None:
            p_t = jnp.where(mask, p_t, 0.0)
        dv_scr_ref[...] += lax.dot_general(
            p_t.astype(do.dtype), do, _NN, preferred_element_type=jnp.float32
        )
        dp_t = lax.dot_general(v, do, _NT, preferred_element_type=jnp.float32)
        ds_t = p_t * (dp_t - delta_t_ref[...]) * sm_scale
        if slope_t is not None:  # through the cap: d/dx c tanh(x / c) = 1 - tanh(x / c)^2
            ds_t = ds_t * slope_t
        dk_scr_ref[...] += lax.dot_general(
            ds_t.astype(q.dtype), q, _NN, preferred_element_type=jnp.float32
        )

    @pl.when(t == pl.num_programs(3) - 1)
    def _finish():
        dk_ref[...] = dk_scr_ref[...].astype(dk_ref.dtype)
        dv_ref[...] = dv_scr_ref[...].astype(dv_ref.dtype)


def _flash_bwd_dq_kernel(
    bounds_ref,  # SMEM [B * nq * 3]: the forward's table
    q_ref,  # [bq, D]
    k_ref,  # [bk, D]
    v_ref,  # [bk, D]
    do_ref,  # [bq, D]
    lse_ref,  # [bq, 1]
    delta_ref,  # [bq, 1]
    q_seg_ref,  # [bq, 1]
    kv_seg_ref,  # [1, bk]
    dq_ref,  # [bq, D]
    dq_scr_ref,  # VMEM [bq, D] f32
    *,
    sm_scale: float,
    causal: bool,
    use_segments: bool,
    window: int | None,
    kv_len: int | None,
    group: int,
    num_q_blocks: int,
    softcap: float | None = None,
):
    b, i, j = pl.program_id(0), pl.program_id(2), pl.program_id(3)
    bq, bk = q_ref.shape[0], k_ref.shape[0]
    base = (b * num_q_blocks + i) * 3
    lo, hi = bounds_ref[base], bounds_ref[base + 2]
    kv_block = lo + j

    @pl.when(j == 0)
    def _init():
        dq_scr_ref[...] = jnp.zeros(dq_scr_ref.shape, jnp.float32)

    @pl.when(kv_block < hi)
    def _step():
        q, k, v, do = q_ref[...], k_ref[...], v_ref[...], do_ref[...]
        s = lax.dot_general(q, k, _NT, preferred_element_type=jnp.float32)
        s, slope = capped_scores_and_slope(s, sm_scale, softcap)
        p = jnp.exp(s - lse_ref[...])
        mask = jnp.ones((bq, bk), dtype=bool)
        cols = kv_block * bk + lax.broadcasted_iota(jnp.int32, (bq, bk), 1)
        if causal:
            mask = mask & (cols * group <= i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0))
        if window is not None:
            rows = i * bq + lax.broadcasted_iota(jnp.int32, (bq, bk), 0)
            mask = mask & ((cols + window) * group > rows)
        if kv_len is not None:
            mask = mask & (cols < kv_len)
        if use_segments:
            mask = mask & (q_seg_ref[...] == kv_seg_ref[...])
        p = jnp.where(mask, p, 0.0)
        dp = lax.dot_general(do, v, _NT, preferred_element_type=jnp.float32)
        ds = p * (dp - delta_ref[...]) * sm_scale
        if slope is not None:
            ds = ds * slope
        dq_scr_ref[...] += lax.dot_general(
            ds.astype(k.dtype), k, _NN, preferred_element_type=jnp.float32
        )

    @pl.when(j == pl.num_programs(3) - 1)
    def _finish():
        dq_ref[...] = dq_scr_ref[...].astype(dq_ref.dtype)


def flash_bwd_tpu(
    bounds,
    qbounds,
    qf,
    kf,
    vf,
    dof,
    lse,
    delta,
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
    interpret,
    window=None,
    num_steps=None,
    softcap=None,
):
    """Head-major layouts as the forward's; lse / delta [B, Hkv, Rp] f32, q_seg [B, Rp],
    kv_seg [B, Sp], bounds [B * nq * 3], qbounds [B * nk * 2]. ``num_steps``: (q steps of the
    dk/dv grid, kv steps of the dq grid), at least the widest ranges (None: all blocks).
    Returns dqf, dkf, dvf."""
    B, Hkv, Rp, D = qf.shape
    Sp = kf.shape[2]
    nq, nk = Rp // block_q, Sp // block_k
    q_steps, kv_steps = num_steps or (nq, nk)
    flags = dict(
        sm_scale=sm_scale,
        causal=causal,
        use_segments=use_segments,
        window=window,
        kv_len=kv_len,
        group=group,
        softcap=softcap,
    )
    sem = pltpu.CompilerParams(
        dimension_semantics=("parallel", "parallel", "parallel", "arbitrary")
    )

    def q_block(b, j, t, qb_ref):  # dk/dv grid (B, Hkv, nk, nq): q block for step t
        base = (b * nk + j) * 2
        lo, hi = qb_ref[base], qb_ref[base + 1]
        return jnp.minimum(lo + t, jnp.maximum(hi - 1, 0))

    q_rows = pl.BlockSpec(
        (None, None, block_q, D), lambda b, h, j, t, r: (b, h, q_block(b, j, t, r), 0)
    )
    kv_own = pl.BlockSpec((None, None, block_k, D), lambda b, h, j, t, r: (b, h, j, 0))
    row_t = pl.BlockSpec(
        (None, None, 1, block_q), lambda b, h, j, t, r: (b, h, 0, q_block(b, j, t, r))
    )
    dk, dv = pl.pallas_call(
        functools.partial(_flash_bwd_dkv_kernel, num_kv_blocks=nk, **flags),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, nk, q_steps),
            in_specs=[
                q_rows,
                kv_own,
                kv_own,
                q_rows,
                row_t,
                row_t,
                pl.BlockSpec((None, 1, block_q), lambda b, h, j, t, r: (b, 0, q_block(b, j, t, r))),
                pl.BlockSpec((None, block_k, 1), lambda b, h, j, t, r: (b, j, 0)),
            ],
            out_specs=[kv_own, kv_own],
            scratch_shapes=[pltpu.VMEM((block_k, D), jnp.float32)] * 2,
        ),
        out_shape=[out_struct(kf.shape, kf.dtype, kf), out_struct(vf.shape, vf.dtype, vf)],
        compiler_params=sem,
        interpret=interpret,
        name="jaxrl_flash_bwd_dkv_tpu",
    )(
        qbounds,
        qf,
        kf,
        vf,
        dof,
        lse[:, :, None, :],
        delta[:, :, None, :],
        q_seg[:, None, :],
        kv_seg[:, :, None],
    )

    def kv_block(b, i, j, br):  # dq grid (B, Hkv, nq, nk): as the forward
        base = (b * nq + i) * 3
        return jnp.minimum(br[base] + j, jnp.maximum(br[base + 2] - 1, 0))

    q_own = pl.BlockSpec((None, None, block_q, D), lambda b, h, i, j, r: (b, h, i, 0))
    kv_rows = pl.BlockSpec(
        (None, None, block_k, D), lambda b, h, i, j, r: (b, h, kv_block(b, i, j, r), 0)
    )
    row = pl.BlockSpec((None, None, block_q, 1), lambda b, h, i, j, r: (b, h, i, 0))
    dq = pl.pallas_call(
        functools.partial(_flash_bwd_dq_kernel, num_q_blocks=nq, **flags),
        grid_spec=pltpu.PrefetchScalarGridSpec(
            num_scalar_prefetch=1,
            grid=(B, Hkv, nq, kv_steps),
            in_specs=[
                q_own,
                kv_rows,
                kv_rows,
                q_own,
                row,
                row,
                pl.BlockSpec((None, block_q, 1), lambda b, h, i, j, r: (b, i, 0)),
                pl.BlockSpec(
                    (None, 1, block_k), lambda b, h, i, j, r: (b, 0, kv_block(b, i, j, r))
                ),
            ],
            out_specs=q_own,
            scratch_shapes=[pltpu.VMEM((block_q, D), jnp.float32)],
        ),
        out_shape=out_struct(qf.shape, qf.dtype, qf),
        compiler_params=sem,
        interpret=interpret,
        name="jaxrl_flash_bwd_dq_tpu",
    )(
        bounds,
        qf,
        kf,
        vf,
        dof,
        lse[..., None],
        delta[..., None],
        q_seg[:, :, None],
        kv_seg[:, None, :],
    )
    return dq, dk, dv
