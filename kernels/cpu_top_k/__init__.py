"""`lax.top_k` on XLA:CPU as one multi-threaded C++ custom call (XLA FFI); `lax.top_k` is its
reference."""

from jaxrl_kernels.cpu_top_k.ops import available, top_k

__all__ = ["available", "top_k"]
