"""Decode attention over a paged KV cache (page pool + per-sequence page table)."""

from jaxrl_kernels.paged_decode_attention.ops import BlockSizes, paged_decode_attention
from jaxrl_kernels.paged_decode_attention.reference import (
    gather_pages,
    paged_decode_attention_reference,
)

__all__ = [
    "BlockSizes",
    "gather_pages",
    "paged_decode_attention",
    "paged_decode_attention_reference",
]

from jaxrl_kernels._util import make_package_callable  # noqa: E402

make_package_callable(__name__, paged_decode_attention)
