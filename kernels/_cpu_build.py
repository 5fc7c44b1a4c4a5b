"""Build and register jaxrl's CPU custom calls (C++ against XLA's FFI headers).

Each is compiled on first use with the host's C++ compiler (`$CXX`, else g++ / clang++ / c++)
for this machine (`-march=native`) and cached under ``$JAXRL_KERNEL_CACHE`` (default
``~/.cache/jaxrl/kernels``), keyed by the source, jaxlib, the flags, the compiler and the CPU's
features. Without a compiler, or when the build fails, `register` warns once and returns False:
callers keep their XLA path. ``JAXRL_CPU_KERNELS=xla`` turns every CPU kernel off.
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

FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-w")
SWITCH = "JAXRL_CPU_KERNELS"  # "xla": never use a CPU kernel


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
def library_path(source: str) -> str | None:
    """`source` compiled to a shared library (built now if not cached), or None with a warning
    saying why."""
    name = os.path.basename(os.path.dirname(source))
    compiler = _compiler()
    if compiler is None:
        warnings.warn(f"jaxrl: no C++ compiler (set CXX or install g++): {name} stays on XLA",
                      stacklevel=2)
        return None
    import jaxlib.version
    with open(source, "rb") as f:
        text = f.read()
    key = hashlib.sha256(b"\0".join([
        text, jaxlib.version.__version__.encode(), " ".join(FLAGS).encode(),
        compiler.encode(), _cpu_features().encode()])).hexdigest()[:16]
    path = os.path.join(cache_dir(), f"{name}-{key}.so")
    if os.path.exists(path):
        return path
    os.makedirs(cache_dir(), exist_ok=True)
    tmp = f"{path}.{os.getpid()}.tmp"  # concurrent builders each rename a whole file
    cmd = [compiler, *FLAGS, "-I", jax.ffi.include_dir(), source, "-o", tmp]
    try:
        result = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    except (OSError, subprocess.TimeoutExpired) as e:
        result = subprocess.CompletedProcess(cmd, 1, "", str(e))
    if result.returncode != 0:
        warnings.warn(f"jaxrl: building the CPU kernel {name} failed ({compiler}): "
                      f"{result.stderr.strip()[-2000:]}; {name} stays on XLA", stacklevel=2)
        return None
    os.replace(tmp, path)
    return path


@functools.cache
def register(source: str, target: str) -> bool:
    """Build `source` and register its handler symbol `target` with XLA:CPU; False: use XLA."""
    if os.environ.get(SWITCH, "").lower() == "xla":
        return False
    path = library_path(source)
    if path is None:
        return False
    library = ctypes.cdll.LoadLibrary(path)
    jax.ffi.register_ffi_target(target, jax.ffi.pycapsule(getattr(library, target)),
                                platform="cpu")
    return True
