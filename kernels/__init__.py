"""Pallas kernels for jaxrl's attention hot paths (prefill and decode).

Per op a package with ``kernel.py`` (TPU Mosaic body), ``kernel_gpu.py`` (GPU Triton body),
``ops.py`` (jitted wrapper, frozen ``BlockSizes``, backend dispatch) and ``reference.py``
(pure jnp).
The folder is ``kernels/``; it installs under the import name ``jaxrl_kernels`` (``kernels`` on
PyPI is another project's). Imports are lazy so ``import jaxrl_kernels`` costs nothing until an op
is used.
"""

import importlib

_EXPORTS = {
    "flash_attention": "jaxrl_kernels.flash_attention.ops",
    "decode_attention": "jaxrl_kernels.decode_attention.ops",
    "paged_decode_attention": "jaxrl_kernels.paged_decode_attention.ops",
}

__all__ = list(_EXPORTS)


def __getattr__(name):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'jaxrl_kernels' has no attribute {name!r}")
