"""Helpers shared by the kernels: backend choice, block arithmetic, mask constants."""

from __future__ import annotations

import math
import numbers

import jax
import jax.numpy as jnp

# A large finite negative: masked logits never produce inf - inf = NaN in the online softmax.
MASK_VALUE = -0.7 * float(jax.numpy.finfo(jax.numpy.float32).max)
# log-sum-exp stored for rows that saw no valid key: exp(s - BIG_LSE) == 0 in the backward.
BIG_LSE = 1e30
LOG2E = math.log2(math.e)
LN2 = math.log(2.0)

BACKENDS = ("tpu", "gpu")


def resolve_backend(backend: str | None, interpret):
    """Which kernel body to run, "tpu" (Mosaic) or "gpu" (Triton), and the ``interpret`` to pass.

    Explicit ``backend`` wins. ``interpret=pltpu.InterpretParams(...)`` means the TPU body under the
    TPU interpreter. Otherwise the running platform decides. CPU has no compiled Pallas, so there
    the kernels always interpret: ``interpret=False`` (the default) or ``True`` runs the GPU body in
    Pallas' generic interpreter (the faster one), so ``attention_impl="pallas"`` works on CPU.
    """
    from jax.experimental.pallas import tpu as pltpu

    platform = jax.default_backend()
    on_cpu = platform not in ("tpu", "gpu", "cuda", "rocm")
    if backend is not None:
        if backend not in BACKENDS:
            raise ValueError(f"backend must be one of {BACKENDS} or None, got {backend!r}")
    elif isinstance(interpret, pltpu.InterpretParams) or platform == "tpu":
        backend = "tpu"
    else:
        backend = "gpu"
    if on_cpu and not interpret:
        interpret = pltpu.InterpretParams() if backend == "tpu" else True
    return backend, interpret


def check_window(window) -> int | None:
    """A sliding window is a positive int (a query at position p sees keys p - window < k <= p),
    or None for no window. Returns it as an int."""
    if window is None:
        return None
    if not isinstance(window, bool) and isinstance(window, numbers.Integral) and window >= 1:
        return int(window)
    raise ValueError(f"window must be a positive int or None, got {window!r}")


def check_softcap(softcap) -> float | None:
    """A logit soft cap is a positive finite number (scores become cap * tanh(scores / cap)), or
    None for none. Returns it as a float."""
    if softcap is None:
        return None
    if (not isinstance(softcap, bool) and isinstance(softcap, numbers.Real)
            and math.isfinite(softcap) and softcap > 0):
        return float(softcap)
    raise ValueError(f"softcap must be a positive finite number or None, got {softcap!r}")


def scaled_scores(s, sm_scale: float, softcap: float | None, out_scale: float = 1.0):
    """The kernels' logits from raw products ``s = q . k``: ``s * sm_scale``, or with a soft cap
    (Gemma 2) ``softcap * tanh(s * sm_scale / softcap)``; times ``out_scale`` (log2 e in the
    base-2 GPU bodies). The cap comes before any mask and before the running max. Without a cap
    this is the one multiply the kernels had before the cap existed (the same program)."""
    if softcap is None:
        return s * (sm_scale * out_scale)
    return jnp.tanh(s * (sm_scale / softcap)) * (softcap * out_scale)


def capped_scores_and_slope(s, sm_scale: float, softcap: float | None):
    """For the backward kernels: the logits (natural base) and ``d logit / d (s * sm_scale)``,
    ``1 - tanh(s * sm_scale / softcap)^2`` with a cap (None without one: the slope is 1)."""
    if softcap is None:
        return s * sm_scale, None
    t = jnp.tanh(s * (sm_scale / softcap))
    return t * softcap, 1.0 - t * t


def window_blocks(window: int, block: int) -> int:
    """Most blocks of ``block`` positions that ``window`` consecutive positions can touch."""
    return cdiv(window - 1, block) + 1


def window_span(num_blocks: int, window: int | None, block: int) -> int:
    """Blocks a decode row's splits cover: all of them, or those a window can touch."""
    return num_blocks if window is None else min(num_blocks, window_blocks(window, block))


def cdiv(a: int, b: int) -> int:
    return -(-a // b)


def round_up(a: int, b: int) -> int:
    return cdiv(a, b) * b


def next_pow2(n: int) -> int:
    return 1 << max(0, (n - 1).bit_length())


def fit_block(block: int, n: int, backend: str) -> int:
    """Shrink a block to the problem: power of two (>= 16) on GPU, multiple of 8 on TPU."""
    if backend == "gpu":
        return max(16, min(next_pow2(block), next_pow2(n)))
    return max(8, min(round_up(block, 8), round_up(n, 8)))


def make_package_callable(module_name: str, fn) -> None:
    """Let ``jaxrl_kernels.<op>`` be called like the op itself.

    Each op lives in a package named like its function (kernels/flash_attention/ holds
    ``flash_attention``). Once the package is imported, Python binds
    ``jaxrl_kernels.flash_attention`` to the package, shadowing the lazy export in
    kernels/__init__.py; making the package callable keeps
    ``jaxrl_kernels.flash_attention(q, k, v)`` working either way.
    """
    import sys
    import types

    module = sys.modules[module_name]

    class _CallablePackage(types.ModuleType):
        def __call__(self, *args, **kwargs):
            return fn(*args, **kwargs)

    module.__class__ = _CallablePackage


def out_struct(shape, dtype, like) -> jax.ShapeDtypeStruct:
    """``ShapeDtypeStruct`` for a ``pallas_call`` output that varies over the same manual mesh axes
    as ``like``, so the ops work inside ``jax.shard_map`` (``check_vma=True``). jax 0.10 spells the
    field ``manual_axis_type`` (aval ``.mat``); earlier releases spelled it ``vma``."""
    aval = jax.typeof(like)
    for attr, kwarg in (("mat", "manual_axis_type"), ("vma", "vma")):
        value = getattr(aval, attr, None)
        if value is not None:
            try:
                return jax.ShapeDtypeStruct(shape, dtype, **{kwarg: value})
            except TypeError:
                continue
    return jax.ShapeDtypeStruct(shape, dtype)
