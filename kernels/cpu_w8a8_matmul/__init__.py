"""A w8a8 projection (per-row int8 input, int8 weight) on XLA:CPU: a C++ custom call (XLA FFI)."""

from jaxrl_kernels.cpu_w8a8_matmul.ops import available, supports, w8a8_matmul
from jaxrl_kernels.cpu_w8a8_matmul.reference import w8a8_matmul_reference

__all__ = ["available", "supports", "w8a8_matmul", "w8a8_matmul_reference"]
