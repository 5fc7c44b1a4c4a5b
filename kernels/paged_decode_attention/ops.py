"""``paged_decode_attention``: decode attention over a paged KV cache (page pool + page table).

Jitted wrapper with static frozen ``BlockSizes`` and an ``interpret`` flag; split-K partials from
the TPU (kernel.py, page table scalar-prefetched) or GPU (kernel_gpu.py) body, combined as in
jaxrl_kernels.decode_attention. Inference only.
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
    resolve_backend,
    window_span,
)
from jaxrl_kernels.decode_attention.ops import run_split_k
from jaxrl_kernels.paged_decode_attention.kernel import paged_decode_tpu
from jaxrl_kernels.paged_decode_attention.kernel_gpu import paged_decode_gpu


@dataclasses.dataclass(frozen=True)
class BlockSizes:
    """num_splits: split-K factor over pages (None: enough programs to fill the chip).
    num_warps / num_stages: GPU (Triton) only. The kv block is one page."""

    num_splits: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None

    def resolve(self, backend: str, batch: int, num_kv_heads: int, pages: int) -> BlockSizes:
        programs, target = (batch, 2) if backend == "tpu" else (batch * num_kv_heads, 264)
        splits = self.num_splits or cdiv(target, programs)
        return BlockSizes(
            num_splits=max(1, min(splits, pages)),
            num_warps=self.num_warps or 4,
            num_stages=self.num_stages or 3,
        )


@functools.partial(
    jax.jit,
    static_argnames=("sm_scale", "block_sizes", "interpret", "backend", "window", "softcap"),
)
def paged_decode_attention(
    q,
    k_pages,
    v_pages,
    lengths,
    page_table,
    *,
    sm_scale=None,
    block_sizes=None,
    interpret=False,
    backend=None,
    window=None,
    softcap=None,
):
    """q [B, Hq, D]; k_pages/v_pages [num_pages, page_size, Hkv, D]; lengths int32 [B];
    page_table int32 [B, pages_per_seq] (logical page i of row b is physical page
    page_table[b, i]) -> [B, Hq, D] (q.dtype).

    Row b attends to its first lengths[b] tokens; entries of page_table past
    cdiv(lengths[b], page_size) are never read (they may hold anything). ``window`` (static int):
    a sliding window as in ``jaxrl_kernels.decode_attention`` (the query at position
    lengths[b] - 1 sees positions p > lengths[b] - 1 - window); the entries of page_table before
    the page holding position lengths[b] - window are never read either. ``softcap``: logit
    soft-capping as in ``jaxrl_kernels.decode_attention``.
    """
    window = check_window(window)
    softcap = check_softcap(softcap)
    B, P = page_table.shape
    page_size = k_pages.shape[1]
    if k_pages.ndim != 4 or k_pages.shape != v_pages.shape or k_pages.shape[3] != q.shape[2]:
        raise ValueError(
            f"pages must be [N, page_size, Hkv, D] with D = {q.shape[2]}; got "
            f"{k_pages.shape}, {v_pages.shape}"
        )
    Hq, D = q.shape[1], q.shape[2]
    Hkv = k_pages.shape[2]
    if Hq % Hkv:
        raise ValueError(f"Hq={Hq} must be a multiple of Hkv={Hkv}")
    if lengths.shape != (B,) or q.shape[0] != B:
        raise ValueError(
            f"q [B, Hq, D], lengths [B] and page_table [B, P] disagree: {q.shape}, "
            f"{lengths.shape}, {page_table.shape}"
        )
    backend, interpret = resolve_backend(backend, interpret)
    if backend == "gpu" and (page_size < 16 or page_size & (page_size - 1)):
        raise ValueError(f"the GPU body needs page_size a power of two >= 16, got {page_size}")
    bs = (block_sizes or BlockSizes()).resolve(backend, B, Hkv, P)
    if window is not None:  # at most one split per page a window can touch
        span = window_span(P, window, page_size)
        bs = dataclasses.replace(bs, num_splits=min(bs.num_splits, span))
    scale = float(D**-0.5 if sm_scale is None else sm_scale)
    lengths = jnp.minimum(lengths.astype(jnp.int32), P * page_size)
    page_table = page_table.astype(jnp.int32)
    return run_split_k(
        q,
        Hkv,
        scale,
        backend,
        lambda q4: paged_decode_tpu(
            q4,
            k_pages,
            v_pages,
            lengths,
            page_table,
            sm_scale=scale,
            num_splits=bs.num_splits,
            interpret=interpret,
            window=window,
            softcap=softcap,
        ),
        lambda q4: paged_decode_gpu(
            q4,
            k_pages,
            v_pages,
            lengths,
            page_table,
            sm_scale=scale,
            num_splits=bs.num_splits,
            num_warps=bs.num_warps,
            num_stages=bs.num_stages,
            interpret=interpret,
            window=window,
            softcap=softcap,
        ),
    )
