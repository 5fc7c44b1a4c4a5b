"""``flash_attention``: jitted wrapper, ``BlockSizes``, backend dispatch and ``custom_vjp``.

Forward: the Pallas kernel (TPU Mosaic body in kernel.py, GPU Triton body in kernel_gpu.py); it
returns the output and the per-row log-sum-exp. Backward (``custom_vjp``), from the saved
log-sum-exp (dS = P * (dP - rowsum(dO * O)), times 1 - tanh(s / c)^2 under a soft cap c): two
Pallas kernels per backend, dk/dv (grid over kv blocks, over the q blocks that see each) and dq
(grid over q blocks, over the forward's kv range), with the forward's block skipping.
``BlockSizes(pallas_backward=False)`` falls back to an XLA recompute chunked over kv (memory
O(T * chunk) per head).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax import lax

from jaxrl_kernels._util import (
    BIG_LSE,
    capped_scores_and_slope,
    cdiv,
    check_softcap,
    check_window,
    fit_block,
    next_pow2,
    resolve_backend,
)
from jaxrl_kernels.flash_attention.kernel import flash_bwd_tpu, flash_fwd_tpu
from jaxrl_kernels.flash_attention.kernel_gpu import flash_bwd_gpu, flash_fwd_gpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """Static tiling. ``None`` picks the backend default. Blocks shrink to small problems.

    block_q counts folded rows (query tokens x G heads sharing a kv head); block_k counts kv tokens.
    num_warps / num_stages are GPU (Triton) only. pallas_backward=False selects the XLA backward
    (a fallback), which scans kv in chunks of bwd_chunk tokens.
    """

    block_q: int | None = None
    block_k: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    pallas_backward: bool = True
    bwd_chunk: int = 512

    def resolve(self, backend: str, head_dim: int) -> BlockSizes:
        if backend == "tpu":
            defaults = dict(block_q=256, block_k=512, num_warps=None, num_stages=None)
        else:
            defaults = dict(
                block_q=128, block_k=64, num_warps=8 if head_dim >= 128 else 4, num_stages=3
            )
        chosen = {
            k: getattr(self, k) if getattr(self, k) is not None else v for k, v in defaults.items()
        }
        return dataclasses.replace(self, **chosen)


@dataclasses.dataclass(frozen=True)
class _Config:
    causal: bool
    sm_scale: float
    block_sizes: BlockSizes
    interpret: object
    backend: str
    window: int | None = None
    softcap: float | None = None


def _fold_q(q, Hkv):
    """[B, T, Hq, D] -> [B, Hkv, T * G, D], row r = t * G + g."""
    B, T, Hq, D = q.shape
    G = Hq // Hkv
    return q.reshape(B, T, Hkv, G, D).transpose(0, 2, 1, 3, 4).reshape(B, Hkv, T * G, D)


def _unfold_q(x, T, G):
    B, Hkv, _, D = x.shape
    return x.reshape(B, Hkv, T, G, D).transpose(0, 2, 1, 3, 4).reshape(B, T, Hkv * G, D)


def _pad_axis(x, axis, size, value=0):
    if x.shape[axis] == size:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, size - x.shape[axis])
    return jnp.pad(x, widths, constant_values=value)


def _static_bounds(R, S, G, bq, bk, causal, window=None):
    """Per q block, [lo, mid, hi) kv blocks from causality and the window alone: int [nq, 3].

    [lo, mid) need no causal or length mask; with a window, blocks that start at or before the
    block's last query minus the window also need the mask (the kernels test that themselves).
    """
    nq, nk = cdiv(R, bq), cdiv(S, bk)
    r_first = np.arange(nq) * bq
    r_last = np.minimum(r_first + bq, R) - 1
    t_first, t_last = r_first // G, r_last // G
    if causal:
        hi = np.minimum(-(-(t_last + 1) // bk), nk)
        mid = np.minimum((t_first + 1) // bk, hi)
    else:
        hi = np.full(nq, nk)
        mid = np.full(nq, nk)
    if S % bk:
        mid = np.minimum(mid, nk - 1)
    lo = np.zeros(nq)
    if window is not None:  # keys before t_first - window + 1 are outside every row's window
        lo = np.minimum(np.maximum(t_first - window + 1, 0) // bk, hi)
        mid = np.clip(mid, lo, hi)
    return np.stack([lo, mid, hi], axis=-1).astype(np.int32)


def _kv_steps(R, S, G, bq, bk, causal, window):
    """Grid steps over kv blocks a q block needs (TPU grids): all of them without a window."""
    if window is None:
        return cdiv(S, bk)
    static = _static_bounds(R, S, G, bq, bk, causal, window)
    return max(1, int((static[:, 2] - static[:, 0]).max()))


def _q_steps(R, S, G, bq, bk, causal, window):
    """Grid steps over the q blocks that see one kv block (TPU dk/dv grid)."""
    if window is None:
        return cdiv(R, bq)
    static = _static_bounds(R, S, G, bq, bk, causal, window)
    blocks = np.arange(cdiv(S, bk))[None, :]
    sees = (blocks >= static[:, :1]) & (blocks < static[:, 2:])  # [nq, nk], contiguous in q
    return max(1, int(sees.sum(0).max()))


def _block_bounds(B, R, S, G, bq, bk, causal, q_seg, kv_seg, window=None):
    """Per (batch row, q block): [lo, mid, hi) kv blocks; [lo, mid) need no mask (but see
    ``_static_bounds`` for a window).

    Returns int32 [B, nq, 3].
    """
    nq, nk = cdiv(R, bq), cdiv(S, bk)
    static = _static_bounds(R, S, G, bq, bk, causal, window)
    lo, hi = static[:, 0], static[:, 2]
    if q_seg is None:
        return jnp.broadcast_to(jnp.asarray(static)[None], (B, nq, 3))
    big = np.iinfo(np.int32).max
    row_ok = jnp.asarray(np.arange(nq * bq) < R).reshape(1, nq, bq)
    col_ok = jnp.asarray(np.arange(nk * bk) < S).reshape(1, nk, bk)
    qs, ks = q_seg.reshape(B, nq, bq), kv_seg.reshape(B, nk, bk)
    q_min = jnp.where(row_ok, qs, big).min(-1)
    q_max = jnp.where(row_ok, qs, -big).max(-1)
    k_min = jnp.where(col_ok, ks, big).min(-1)
    k_max = jnp.where(col_ok, ks, -big).max(-1)
    blocks = np.arange(nk)[None, :]
    in_range = jnp.asarray((blocks >= lo[:, None]) & (blocks < hi[:, None]))[None]  # [1, nq, nk]
    overlap = (k_max[:, None, :] >= q_min[:, :, None]) & (k_min[:, None, :] <= q_max[:, :, None])
    overlap = overlap & in_range
    some = overlap.any(-1)
    first = jnp.argmax(overlap, axis=-1)
    last = nk - 1 - jnp.argmax(overlap[..., ::-1], axis=-1)
    lo = jnp.where(some, first, 0)
    hi_seg = jnp.where(some, last + 1, 0)
    return jnp.stack([lo, lo, hi_seg], axis=-1).astype(jnp.int32)


def _segments_and_bounds(segment_ids, B, R, Rp, S, Sp, G, bq, bk, causal, window):
    """Folded q segment ids [B, Rp], kv segment ids [B, Sp] and the block table [B, nq, 3]."""
    if segment_ids is None:
        q_seg = jnp.zeros((B, Rp), jnp.int32)
        kv_seg = jnp.zeros((B, Sp), jnp.int32)
        return q_seg, kv_seg, _block_bounds(B, R, S, G, bq, bk, causal, None, None, window)
    seg = segment_ids.astype(jnp.int32)
    q_seg = _pad_axis(jnp.repeat(seg, G, axis=1), 1, Rp, -2)
    kv_seg = _pad_axis(seg, 1, Sp, -1)
    return q_seg, kv_seg, _block_bounds(B, R, S, G, bq, bk, causal, q_seg, kv_seg, window)


def _gpu_tiling(T, S, G, bs: BlockSizes):
    """(Gp, bt, bq, bk, Tp, Sp): G padded to a power of two, bt tokens x Gp heads = bq rows per q
    block (>= 16 for the tensor cores), bk kv tokens per block, padded lengths."""
    Gp = next_pow2(G)
    bt = max(max(1, 16 // Gp), min(max(1, next_pow2(bs.block_q) // Gp), next_pow2(T)))
    bk = fit_block(bs.block_k, S, "gpu")
    return Gp, bt, bt * Gp, bk, cdiv(T, bt) * bt, cdiv(S, bk) * bk


def _forward(q, k, v, segment_ids, cfg: _Config):
    """Output [B, T, Hq, D] and log-sum-exp [B, Hkv, T * G] (folded rows r = t * G + g)."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bs = cfg.block_sizes.resolve(cfg.backend, D)
    common = dict(
        sm_scale=cfg.sm_scale,
        causal=cfg.causal,
        use_segments=segment_ids is not None,
        window=cfg.window,
        interpret=cfg.interpret,
        softcap=cfg.softcap,
    )
    if cfg.backend == "tpu":  # head-major layout: [B, Hkv, rows, D] tiles for the TPU pipeline
        R = T * G
        bq, bk = fit_block(bs.block_q, R, "tpu"), fit_block(bs.block_k, S, "tpu")
        Rp, Sp = cdiv(R, bq) * bq, cdiv(S, bk) * bk
        q_seg, kv_seg, bounds = _segments_and_bounds(
            segment_ids, B, R, Rp, S, Sp, G, bq, bk, cfg.causal, cfg.window
        )
        o, lse = flash_fwd_tpu(
            bounds.reshape(-1),
            _pad_axis(_fold_q(q, Hkv), 2, Rp),
            _pad_axis(k.transpose(0, 2, 1, 3), 2, Sp),
            _pad_axis(v.transpose(0, 2, 1, 3), 2, Sp),
            q_seg[:, :, None],
            kv_seg[:, None, :],
            kv_len=S if Sp != S else None,
            group=G,
            block_q=bq,
            block_k=bk,
            num_kv_steps=_kv_steps(R, S, G, bq, bk, cfg.causal, cfg.window),
            **common,
        )
        return _unfold_q(o[:, :, :R], T, G), lse[:, :, :R, 0]
    # GPU: q, k, v in their own layouts (reshapes only); G padded to a power of two for Triton.
    Gp, bt, bq, bk, Tp, Sp = _gpu_tiling(T, S, G, bs)
    q5 = _pad_axis(_pad_axis(q.reshape(B, T, Hkv, G, D), 3, Gp), 1, Tp)
    q_seg, kv_seg, bounds = _segments_and_bounds(
        segment_ids, B, T * Gp, Tp * Gp, S, Sp, Gp, bq, bk, cfg.causal, cfg.window
    )
    o5, lse = flash_fwd_gpu(
        _pad_axis(bounds, 2, 4),
        q5,
        _pad_axis(k, 1, Sp),
        _pad_axis(v, 1, Sp),
        q_seg,
        kv_seg,
        kv_len=S if Sp != S else None,
        group=Gp,
        block_q=bq,
        block_k=bk,
        num_warps=bs.num_warps,
        num_stages=bs.num_stages,
        **common,
    )
    o = o5[:, :T, :, :G].reshape(B, T, Hq, D)
    lse = lse.reshape(B, Hkv, Tp, Gp)[:, :, :T, :G].reshape(B, Hkv, T * G)
    return o, lse


def _backward(q, k, v, segment_ids, o, lse, do, cfg: _Config):
    """dq, dk, dv from the saved log-sum-exp, scanning kv in chunks of ``bwd_chunk`` tokens."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    f32 = jnp.float32
    qf = _fold_q(q, Hkv).astype(f32)  # [B, Hkv, R, D]
    dof = _fold_q(do, Hkv).astype(f32)
    delta = jnp.sum(_fold_q(o, Hkv).astype(f32) * dof, axis=-1)  # [B, Hkv, R]
    chunk = min(cfg.block_sizes.bwd_chunk, S)
    n, Sp = cdiv(S, chunk), cdiv(S, chunk) * chunk
    kc = _pad_axis(k.transpose(0, 2, 1, 3).astype(f32), 2, Sp)
    vc = _pad_axis(v.transpose(0, 2, 1, 3).astype(f32), 2, Sp)
    kc = kc.reshape(B, Hkv, n, chunk, D).transpose(2, 0, 1, 3, 4)
    vc = vc.reshape(B, Hkv, n, chunk, D).transpose(2, 0, 1, 3, 4)
    rows_t = jnp.arange(T * G) // G
    if segment_ids is not None:
        q_seg = jnp.repeat(segment_ids, G, axis=1)
        kv_seg = _pad_axis(segment_ids, 1, Sp, -1).reshape(B, n, chunk).transpose(1, 0, 2)
    else:
        kv_seg = jnp.zeros((n, B, chunk), jnp.int32)

    def body(dq, xs):
        c, k_c, v_c, seg_c = xs
        cols = c * chunk + jnp.arange(chunk)
        mask = (cols < S)[None, :]
        if cfg.causal:
            mask = mask & (cols[None, :] <= rows_t[:, None])
        if cfg.window is not None:
            mask = mask & (cols[None, :] > rows_t[:, None] - cfg.window)
        mask = mask[None]  # [1, R, C]
        if segment_ids is not None:
            mask = mask & (q_seg[:, :, None] == seg_c[:, None, :])
        s, slope = capped_scores_and_slope(
            jnp.einsum("bhrd,bhcd->bhrc", qf, k_c), cfg.sm_scale, cfg.softcap
        )
        p = jnp.where(mask[:, None], jnp.exp(s - lse[..., None]), 0.0)
        dv_c = jnp.einsum("bhrc,bhrd->bhcd", p, dof)
        dp = jnp.einsum("bhrd,bhcd->bhrc", dof, v_c)
        ds = p * (dp - delta[..., None]) * cfg.sm_scale
        if slope is not None:  # through the cap: d/dx c tanh(x / c) = 1 - tanh(x / c)^2
            ds = ds * slope
        dq = dq + jnp.einsum("bhrc,bhcd->bhrd", ds, k_c)
        dk_c = jnp.einsum("bhrc,bhrd->bhcd", ds, qf)
        return dq, (dk_c, dv_c)

    dq, (dk, dv) = lax.scan(body, jnp.zeros_like(qf), (jnp.arange(n), kc, vc, kv_seg))

    def unchunk(x):  # [n, B, Hkv, C, D] -> [B, S, Hkv, D]
        return x.transpose(1, 0, 3, 2, 4).reshape(B, Sp, Hkv, D)[:, :S]

    dq = _unfold_q(dq, T, G)
    return dq.astype(q.dtype), unchunk(dk).astype(k.dtype), unchunk(dv).astype(v.dtype)


def _transpose_bounds(bounds, nq, nk):
    """Per kv block, the q block range [q_lo, q_hi) whose kv range includes it: [B, nk, 2]."""
    blocks = jnp.arange(nk)[None, None, :]
    needed = (blocks >= bounds[:, :, 0:1]) & (blocks < bounds[:, :, 2:3])  # [B, nq, nk]
    seen = needed.any(axis=1)
    q_lo = jnp.where(seen, jnp.argmax(needed, axis=1), 0)
    q_hi = jnp.where(seen, nq - jnp.argmax(needed[:, ::-1, :], axis=1), 0)
    return jnp.stack([q_lo, q_hi], axis=-1).astype(jnp.int32)


def _backward_tpu(q, k, v, segment_ids, o, lse, do, cfg: _Config):
    """dq, dk, dv with the Pallas (Mosaic) backward kernels, in the forward's head-major layout."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G, R = Hq // Hkv, T * (Hq // Hkv)
    bs = cfg.block_sizes.resolve("tpu", D)
    bq, bk = fit_block(bs.block_q, R, "tpu"), fit_block(bs.block_k, S, "tpu")
    Rp, Sp = cdiv(R, bq) * bq, cdiv(S, bk) * bk
    q_seg, kv_seg, bounds = _segments_and_bounds(
        segment_ids, B, R, Rp, S, Sp, G, bq, bk, cfg.causal, cfg.window
    )
    delta = jnp.sum(_fold_q(o, Hkv).astype(jnp.float32) * _fold_q(do, Hkv), axis=-1)
    steps = (
        _q_steps(R, S, G, bq, bk, cfg.causal, cfg.window),
        _kv_steps(R, S, G, bq, bk, cfg.causal, cfg.window),
    )
    dqf, dkf, dvf = flash_bwd_tpu(
        bounds.reshape(-1),
        _transpose_bounds(bounds, Rp // bq, Sp // bk).reshape(-1),
        _pad_axis(_fold_q(q, Hkv), 2, Rp),
        _pad_axis(k.transpose(0, 2, 1, 3), 2, Sp),
        _pad_axis(v.transpose(0, 2, 1, 3), 2, Sp),
        _pad_axis(_fold_q(do.astype(q.dtype), Hkv), 2, Rp),
        _pad_axis(lse, 2, Rp, BIG_LSE),
        _pad_axis(delta, 2, Rp),
        q_seg,
        kv_seg,
        sm_scale=cfg.sm_scale,
        causal=cfg.causal,
        use_segments=segment_ids is not None,
        window=cfg.window,
        kv_len=S if Sp != S else None,
        group=G,
        block_q=bq,
        block_k=bk,
        num_steps=steps,
        interpret=cfg.interpret,
        softcap=cfg.softcap,
    )
    unfold_kv = lambda x: x[:, :, :S].transpose(0, 2, 1, 3)
    return _unfold_q(dqf[:, :, :R], T, G), unfold_kv(dkf), unfold_kv(dvf)


def _backward_gpu(q, k, v, segment_ids, o, lse, do, cfg: _Config):
    """dq, dk, dv with the Pallas (Triton) backward kernels, in the forward's layouts."""
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    bs = cfg.block_sizes.resolve("gpu", D)
    Gp, bt, bq, bk, Tp, Sp = _gpu_tiling(T, S, G, bs)
    nq, nk = Tp // bt, Sp // bk

    def q_layout(x):  # [B, T, Hq, D] -> [B, Tp, Hkv, Gp, D]
        return _pad_axis(_pad_axis(x.reshape(B, T, Hkv, G, D), 3, Gp), 1, Tp)

    def rows(x_BTHq, value):  # [B, T, Hq] -> folded rows [B, Hkv, Tp * Gp]
        x = x_BTHq.reshape(B, T, Hkv, G).transpose(0, 2, 1, 3)
        return _pad_axis(_pad_axis(x, 3, Gp, value), 2, Tp, value).reshape(B, Hkv, Tp * Gp)

    q_seg, kv_seg, bounds = _segments_and_bounds(
        segment_ids, B, T * Gp, Tp * Gp, S, Sp, Gp, bq, bk, cfg.causal, cfg.window
    )
    qbounds = _pad_axis(_transpose_bounds(bounds, nq, nk), 2, 4)
    lse_BTHq = lse.reshape(B, Hkv, T, G).transpose(0, 2, 1, 3).reshape(B, T, Hq)
    delta = jnp.sum(o.astype(jnp.float32) * do.astype(jnp.float32), axis=-1)
    dq5, dk, dv = flash_bwd_gpu(
        _pad_axis(bounds, 2, 4),
        qbounds,
        q_layout(q),
        _pad_axis(k, 1, Sp),
        _pad_axis(v, 1, Sp),
        q_layout(do.astype(q.dtype)),
        rows(lse_BTHq, BIG_LSE),
        rows(delta, 0.0),
        q_seg,
        kv_seg,
        sm_scale=cfg.sm_scale,
        causal=cfg.causal,
        use_segments=segment_ids is not None,
        window=cfg.window,
        kv_len=S if Sp != S else None,
        block_q=bq,
        block_k=bk,
        num_warps=bs.num_warps,
        num_stages=bs.num_stages,
        interpret=cfg.interpret,
        softcap=cfg.softcap,
    )
    return dq5[:, :T, :, :G].reshape(B, T, Hq, D), dk[:, :S], dv[:, :S]


@functools.partial(jax.custom_vjp, nondiff_argnums=(4,))
def _flash(q, k, v, segment_ids, cfg):
    return _forward(q, k, v, segment_ids, cfg)[0]


def _flash_fwd(q, k, v, segment_ids, cfg):
    o, lse = _forward(q, k, v, segment_ids, cfg)
    return o, (q, k, v, segment_ids, o, lse)


def _flash_bwd(cfg, residuals, do):
    q, k, v, segment_ids, o, lse = residuals
    if not cfg.block_sizes.pallas_backward:
        backward = _backward
    else:
        backward = _backward_gpu if cfg.backend == "gpu" else _backward_tpu
    dq, dk, dv = backward(q, k, v, segment_ids, o, lse, do, cfg)
    return dq, dk, dv, None


_flash.defvjp(_flash_fwd, _flash_bwd)


@functools.partial(
    jax.jit,
    static_argnames=(
        "causal", "sm_scale", "block_sizes", "interpret", "backend", "window", "softcap"
    ),
)
def flash_attention(
    q,
    k,
    v,
    *,
    causal=True,
    segment_ids=None,
    sm_scale=None,
    block_sizes=None,
    interpret=False,
    backend=None,
    window=None,
    softcap=None,
):
    """Flash attention. q [B, T, Hq, D], k/v [B, S, Hkv, D] -> [B, T, Hq, D] (q.dtype).

    Hq must be a multiple of Hkv (query head n uses kv head n // (Hq // Hkv)). Causal masking is
    top-left aligned (key j visible to query i iff j <= i). ``segment_ids`` [B, T] int32 >= 0
    (needs T == S) restricts attention to equal ids: packing, and padding with its own id. Blocks
    fully masked by causality or segments are skipped; skipping by segments is complete when ids
    are non-decreasing along the sequence (packed layout), otherwise conservative but exact.
    ``interpret``: False (compiled; on CPU, where nothing compiles, the GPU body interpreted);
    True (generic interpreter, GPU body on CPU); or ``pltpu.InterpretParams()`` (TPU interpreter,
    TPU body). ``backend`` "tpu" | "gpu" forces a body.
    ``window`` (static int, needs ``causal``): a sliding window, query i sees only keys
    i - window < j <= i, as transformers' sliding-window layers (Mistral, Gemma 2 / 3:
    ``masking_utils.sliding_window_overlay``, kv_idx > q_idx - window, on top of the causal mask);
    with segments, on top of them too. kv blocks wholly before a q block's window are skipped, so
    the cost is O(T * window). ``None`` (default): no window, the programs of no-window attention.
    ``softcap`` (static positive float): logit soft-capping (Gemma 2's ``attn_logit_softcapping``),
    the scaled scores s become softcap * tanh(s / softcap) before the mask and the softmax; the
    backward carries the cap's slope 1 - tanh(s / softcap)^2. ``None`` (default): no cap, the
    programs of uncapped attention.
    Differentiable (custom_vjp with Pallas backward kernels; see the module docstring).
    """
    B, T, Hq, D = q.shape
    if k.ndim != 4 or k.shape != v.shape or k.shape[0] != B or k.shape[3] != D:
        raise ValueError(
            f"k/v must be [B, S, Hkv, D] matching q {q.shape}; got {k.shape}, {v.shape}"
        )
    if Hq % k.shape[2]:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={k.shape[2]}")
    if segment_ids is not None and (segment_ids.shape != (B, T) or k.shape[1] != T):
        raise ValueError(
            f"segment_ids must be [B, T] = {(B, T)} with S == T; got "
            f"{segment_ids.shape}, S={k.shape[1]}"
        )
    window = check_window(window)
    softcap = check_softcap(softcap)
    if window is not None and not causal:
        raise ValueError(
            f"window={window} needs causal=True (sliding windows are causal), got causal={causal!r}"
        )
    backend, interpret = resolve_backend(backend, interpret)
    cfg = _Config(
        causal=bool(causal),
        sm_scale=float(D**-0.5 if sm_scale is None else sm_scale),
        block_sizes=block_sizes or BlockSizes(),
        interpret=interpret,
        backend=backend,
        window=window,
        softcap=softcap,
    )
    return _flash(q, k, v, segment_ids, cfg)
