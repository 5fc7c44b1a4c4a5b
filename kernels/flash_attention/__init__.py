"""Flash attention (prefill / training): causal, GQA-folded, segment ids, block skipping."""

from jaxrl_kernels.flash_attention.ops import BlockSizes, flash_attention
from jaxrl_kernels.flash_attention.reference import flash_attention_reference

__all__ = ["BlockSizes", "flash_attention", "flash_attention_reference"]

from jaxrl_kernels._util import make_package_callable  # noqa: E402

make_package_callable(__name__, flash_attention)
