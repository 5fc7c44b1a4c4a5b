"""``w8a8_matmul``: a w8a8 projection on XLA:CPU (int8 weights, each row's input quantized to
int8 at run time), one multi-threaded custom call on AVX512-VNNI.

`jaxrl.models.quant`'s XLA form quantizes the input in fused elementwise ops and runs an
int8 x int8 -> int32 library dot, which on XLA:CPU is slower than its bf16 dot (docs/design.md);
kernel.cc quantizes each row and contracts with vpdpbusd, which does four byte products a lane.
The result equals the XLA form's (the int32 sums are exact; the scales are applied in the same
order). Built on first use (`jaxrl_kernels._cpu_build`); `available()` is False without a
compiler, on a CPU without AVX512 BW / VBMI / VNNI, or with ``JAXRL_CPU_KERNELS=xla``: callers
keep the XLA path. Inference only; CPU only.
"""

from __future__ import annotations

import ctypes
import functools
import os

import jax
import jax.numpy as jnp

from jaxrl_kernels import _cpu_build

TARGET = "jaxrl_cpu_w8a8_matmul"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))
MAX_K = 65536  # sums of K products (p + 128) q stay in int32 (255 * 127 * 65536 < 2^31)


@functools.cache
def available() -> bool:
    """Whether the kernel is built for this CPU and registered with XLA:CPU (False: use XLA)."""
    if not _cpu_build.register(SOURCE, TARGET):
        return False
    library = ctypes.cdll.LoadLibrary(_cpu_build.library_path(SOURCE))
    return bool(library.jaxrl_cpu_w8a8_matmul_supported())


def supports(k: int, n: int, dtype) -> bool:
    """Shapes and dtypes the kernel takes: K and N multiples of 16, K <= 65536, x f32 or bf16."""
    return k % 16 == 0 and n % 16 == 0 and 0 < k <= MAX_K and jnp.dtype(dtype) in DTYPES


def w8a8_matmul(x_MK, q_KN, scale_N):
    """`[M, N]` in `x`'s dtype: `x` quantized per row to int8 (`quant.quantize_activations`),
    contracted with the int8 weight `q` in int32, times each row's scale and `scale_N`."""
    if not available():
        raise RuntimeError("the CPU w8a8 matmul kernel is not available here "
                           f"({_cpu_build.SWITCH}={os.environ.get(_cpu_build.SWITCH)!r}, a CPU "
                           "without AVX512 VNNI, or its build failed: see the warning)")
    (m, k), n = x_MK.shape, q_KN.shape[1]
    if q_KN.shape != (k, n) or scale_N.shape != (n,) or q_KN.dtype != jnp.int8:
        raise ValueError(f"w8a8_matmul wants x [M, K], q [K, N] int8 and scale [N]; got "
                         f"{x_MK.shape}, {q_KN.shape} {q_KN.dtype}, {scale_N.shape}")
    if not supports(k, n, x_MK.dtype):
        raise ValueError(f"w8a8_matmul takes K, N multiples of 16 (K <= {MAX_K}) and x in "
                         f"{[d.name for d in DTYPES]}; got K={k}, N={n}, {x_MK.dtype}")
    out = jax.ShapeDtypeStruct((m, n), x_MK.dtype)
    return jax.ffi.ffi_call(TARGET, out)(x_MK, q_KN, scale_N.astype(jnp.float32))
