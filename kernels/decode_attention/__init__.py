"""Decode attention over a contiguous KV cache: ragged lengths, split-K, GQA-folded."""

from jaxrl_kernels.decode_attention.ops import BlockSizes, decode_attention
from jaxrl_kernels.decode_attention.reference import decode_attention_reference

__all__ = ["BlockSizes", "decode_attention", "decode_attention_reference"]

from jaxrl_kernels._util import make_package_callable  # noqa: E402

make_package_callable(__name__, decode_attention)
