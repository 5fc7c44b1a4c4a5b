"""``write_and_attend``: one decode step's cache write and attention on XLA:CPU, one custom call.

XLA:CPU runs a decode step's attention as per-row batched dots of a few query heads against the
cache (~33 GFLOP/s at batch 128) and writes the step's entries by a select over the whole
cache; kernel.cc writes them in place and attends each row's filled slots only. It is compiled
on first use with the host's C++ compiler (`$CXX`, else g++ / clang++ / c++) for this machine
(`-march=native`) and cached under ``$JAXRL_KERNEL_CACHE`` (default
``~/.cache/jaxrl/kernels``), keyed by the source, jaxlib, the flags and the CPU's features.
Without a compiler, or with ``JAXRL_CPU_ATTENTION=xla``, `available()` is False and callers keep
the XLA path. Inference only (no gradient); CPU only.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import warnings

import jax
import jax.numpy as jnp
import numpy as np

TARGET = "jaxrl_cpu_decode_attention"
SOURCE = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kernel.cc")
FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
SWITCH = "JAXRL_CPU_ATTENTION"  # "xla": never use the kernel
DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float32))


def cache_dir() -> str:
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"),
                           "jaxrl", "kernels")
    return os.environ.get("JAXRL_KERNEL_CACHE") or default


def _cpu_features() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            return next((line for line in f if line.startswith("flags")), "")
    except OSError:
        import platform
        return platform.processor()


def _compiler() -> str | None:
    return os.environ.get("CXX") or next(
        (c for c in ("g++", "clang++", "c++") if shutil.which(c)), None)


@functools.cache
def library_path() -> str | None:
    """The compiled kernel's path (built now if not cached), or None with a warning saying why."""
    compiler = _compiler()
    if compiler is None:
        warnings.warn("jaxrl: no C++ compiler (set CXX or install g++): CPU decode attention "
                      "stays on XLA", stacklevel=2)
        return None
    import jaxlib.version
    with open(SOURCE, "rb") as f:
        source = f.read()
    key = hashlib.sha256(b"\0".join([
        source, jaxlib.version.__version__.encode(), " ".join(FLAGS).encode(),
        compiler.encode(), _cpu_features().encode()])).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"cpu_decode_attention-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # concurrent builders each rename a whole file
    cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), SOURCE, "-o", tmp]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        result = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if result.returncode != 0:
        warnings.warn(f"jaxrl: building the CPU decode attention kernel failed ({compiler}): "
                      f"{result.stderr.strip()[-2000:]}; CPU decode attention stays on XLA",
                      stacklevel=2)
        return None
    os.replace(tmp, path)
    return path


@functools.cache
def available() -> bool:
    """Whether the kernel is built and registered with XLA:CPU (False: use the XLA path)."""
    if os.environ.get(SWITCH, "").lower() == "xla":
        return False
    path = library_path()
    if path is None:
        return False
    library = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(TARGET, jax.ffi.pycapsule(library.jaxrl_cpu_decode_attention),
                                platform="cpu")
    return True


def supports(head_dim: int, cache_dtype) -> bool:
    """Shapes and dtypes the kernel takes: head_dim a multiple of 16, a bf16 or f32 cache."""
    return head_dim % 16 == 0 and jnp.dtype(cache_dtype) in DTYPES


def write_and_attend(q_BHD, k_new_BKD, v_new_BKD, k_cache_BKDS, v_cache_BKSD, slot_B, n_B,
                     scale: float):
    """Write each row's new key and value at `slot_B` (clamped into the cache), then attend its
    queries (`scale`d) to its first `n_B` entries (at least one). The heads-major caches are
    updated in place where XLA can alias them. Returns `(out_BHD, k_cache, v_cache)`."""
    if not available():
        raise RuntimeError(f"the CPU decode attention kernel is not available here ({SWITCH}="
                           f"{os.environ.get(SWITCH)!r}, or its build failed: see the warning)")
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
