"""``write_and_attend``: one decode step's cache write and attention on XLA:CPU, one custom call.

XLA:CPU runs a decode step's attention as per-row batched dots of a few query heads against the
cache (~33 GFLOP/s at batch 128) and writes the step's entries by a select over the whole
cache; kernel.cc writes them in place and attends each row's filled slots only. It is built on
first use (`jaxrl_kernels._cpu_build`); without a compiler, or with ``JAXRL_CPU_KERNELS=xla``,
`available()` is False and callers keep the XLA path. Inference only (no gradient); CPU only.
"""

from __future__ import annotations

import os

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl_kernels import _cpu_build

TARGET = "jaxrl_cpu_decode_attention"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (False: use the XLA path)."""
    return _cpu_build.register(SOURCE, TARGET)


def supports(head_dim: int, cache_dtype) -> bool:
    """Shapes and dtypes the kernel takes: head_dim a multiple of 16, a bf16 or f32 cache."""
    return head_dim % 16 == 0 and jnp.dtype(cache_dtype) in DTYPES


def write_and_attend(q_BHD, k_new_BKD, v_new_BKD, k_cache_BKDS, v_cache_BKSD, slot_B, n_B,
                     scale: float):
    """Write each row's new key and value at `slot_B` (clamped into the cache), then attend its
    queries (`scale`d) to its first `n_B` entries (at least one). The heads-major caches are
    updated in place where XLA can alias them. Returns `(out_BHD, k_cache, v_cache)`."""
    if not available():
        raise RuntimeError("the CPU decode attention kernel is not available here "
                           f"({_cpu_build.SWITCH}={os.environ.get(_cpu_build.SWITCH)!r}, or its "
                           "build failed: see the warning)")
    b, hq, d = q_BHD.shape
    hkv, s = k_cache_BKDS.shape[1], k_cache_BKDS.shape[3]
    if k_cache_BKDS.shape != (b, hkv, d, s) or v_cache_BKSD.shape != (b, hkv, s, d):
        raise ValueError(f"caches {k_cache_BKDS.shape} / {v_cache_BKSD.shape} do not match "
                         f"queries {q_BHD.shape}: want [B, K, D, S] and [B, K, S, D]")
    dtype = k_cache_BKDS.dtype
    q_BKGD = q_BHD.astype(jnp.float32).reshape(b, hkv, hq // hkv, d)
    shapes = (jax.ShapeDtypeStruct(q_BKGD.shape, jnp.float32),
              jax.ShapeDtypeStruct(k_cache_BKDS.shape, dtype),
              jax.ShapeDtypeStruct(v_cache_BKSD.shape, dtype))
    call = jax.ffi.ffi_call(TARGET, shapes, input_output_aliases={3: 1, 4: 2})
    out, k_cache, v_cache = call(q_BKGD, k_new_BKD.astype(dtype), v_new_BKD.astype(dtype),
                                 k_cache_BKDS, v_cache_BKSD, slot_B.astype(jnp.int32),
                                 n_B.astype(jnp.int32), scale=np.float32(scale))
    return out.reshape(b, hq, d).astype(q_BHD.dtype), k_cache, v_cache
