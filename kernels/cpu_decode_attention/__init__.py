"""One decode step's KV-cache write and attention on XLA:CPU: a C++ custom call (XLA FFI)."""

from jaxrl_kernels.cpu_decode_attention.ops import available, supports, write_and_attend
from jaxrl_kernels.cpu_decode_attention.reference import write_and_attend_reference

__all__ = ["available", "supports", "write_and_attend", "write_and_attend_reference"]
