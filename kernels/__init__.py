"""Kernels for jaxrl's attention hot paths (prefill and decode).

Per Pallas op a package with ``kernel.py`` (TPU Mosaic body), ``kernel_gpu.py`` (GPU Triton
body), ``ops.py`` (jitted wrapper, frozen ``BlockSizes``, backend dispatch) and ``reference.py``
(pure jnp). The CPU kernels (``cpu_decode_attention``, ``cpu_top_k``) are C++ XLA FFI custom
calls: ``kernel.cc``, ``ops.py`` (the call) and a reference (``reference.py``, or the
``lax`` op), built on first use by ``_cpu_build.py``.
The folder is ``kernels/``; it installs under the import name ``jaxrl_kernels`` (``kernels`` on
PyPI is another project's). Imports are lazy so ``import jaxrl_kernels`` costs nothing until an op
is used.
"""

import importlib
import os
import sys


def _yield_the_name_kernels():
    """This folder imported under its own name, `kernels`: a checkout's root is on `sys.path`
    (`python -m ...` or a test run from it, `launch/eval.py`). That name belongs to Hugging Face's
    kernel hub package, a dependency of `transformers` >= 5.25, which imports it when any model
    module loads; found here first, it would fail there. Load the next `kernels` on the path
    in this module's place (`import` returns what `sys.modules` holds once this body ends); with
    none installed, this module stays."""
    from importlib.machinery import PathFinder
    from importlib.util import module_from_spec

    root = os.path.dirname(os.path.dirname(os.path.realpath(__file__)))
    rest = [p for p in sys.path if os.path.realpath(p or os.curdir) != root]
    spec = PathFinder.find_spec("kernels", rest)
    if spec is None or spec.loader is None:
        return
    module = module_from_spec(spec)
    sys.modules["kernels"] = module  # before it runs: its own `kernels.x` imports resolve to it
    try:
        spec.loader.exec_module(module)
    except BaseException:
        sys.modules.pop("kernels", None)
        raise


if __name__ == "kernels":
    _yield_the_name_kernels()

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
