"""Low-rank adapters (LoRA; Hu et al. 2021, arXiv:2106.09685) on the transformer's projections.

A targeted projection `y = x W` becomes `y = x W + s (x A) B` with `A: [in..., r]`, `B: [r,
out...]` and `s = alpha / r` (rsLoRA: `alpha / sqrt(r)`). `A` starts as PEFT's default
(uniform in +-1/sqrt(fan_in)), `B` at zero, so a fresh adapter leaves the model unchanged. The
adapters of projection `q_proj` are the parameters `q_lora_a` / `q_lora_b` beside it; their
logical axes are the weight's input axes plus `lora_rank`, and `lora_rank` plus its output axes,
so they shard with the weight on both meshes.

Parameters travel as pure nested dicts (`nnx.to_pure_dict`); `split` / `join` separate a LoRA
model's dict into the frozen base and the trainable adapters and put them back together, and
`merge` folds the adapters into the base weights (`W + s A B`).

Adapters with one more leading axis than their layout (`[B, in..., r]`, `[B, r, out...]`) are
one adapter per batch row: `delta` then computes each row's `s (x[b] A[b]) B[b]` (the multi-
adapter decode of `jaxrl.generate.multi_lora`, which gathers each slot's adapter).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import LoraConfig

ADAPTER_SUFFIXES = ("_lora_a", "_lora_b")
RANK_AXIS = "lora_rank"
ADAPTER_DTYPE = jnp.float32


def add_adapters(module: nnx.Module, lora: LoraConfig, name: str, in_shape: tuple,
                 in_axes: tuple, out_shape: tuple, out_axes: tuple, rngs: nnx.Rngs) -> None:
    """Give `module` the adapters `{name}_lora_a` / `{name}_lora_b` of its `{name}_proj` when
    `name` is one of `lora.targets` (nothing otherwise)."""
    if not lora.enabled or name not in lora.targets:
        return
    bound = 1.0 / math.sqrt(math.prod(in_shape))
    a = jax.random.uniform(rngs.params(), (*in_shape, lora.rank), ADAPTER_DTYPE, -bound, bound)
    setattr(module, f"{name}_lora_a", nnx.Param(a, logical_axes=(*in_axes, RANK_AXIS)))
    b = jnp.zeros((lora.rank, *out_shape), ADAPTER_DTYPE)
    setattr(module, f"{name}_lora_b", nnx.Param(b, logical_axes=(RANK_AXIS, *out_axes)))


def delta(module: nnx.Module, lora: LoraConfig, name: str, x, n_in: int):
    """`s (x A) B` of `module`'s `name` adapter, in `x`'s dtype (0 when it has none); `n_in`:
    how many trailing axes of `x` the projection contracts."""
    a = getattr(module, f"{name}_lora_a", None)
    if a is None:
        return 0
    b = getattr(module, f"{name}_lora_b")
    a, b = a[...].astype(x.dtype), b[...].astype(x.dtype)
    if a.ndim == n_in + 2:  # one adapter per batch row (multi-adapter decoding)
        return (lora.scale * per_row_product(x, a, b, n_in)).astype(x.dtype)
    h = jnp.tensordot(x, a, axes=n_in)
    return (lora.scale * jnp.tensordot(h, b, axes=1)).astype(x.dtype)


def per_row_product(x, a_B, b_B, n_in: int):
    """`(x[i] A[i]) B[i]` for each row `i` of the leading axis: `x: [B, ..., in...]`, `a_B: [B,
    in..., r]`, `b_B: [B, r, out...]` (each row's own adapter, gathered by
    `jaxrl.generate.multi_lora`); two batched matmuls."""
    rows, rank = x.shape[0], a_B.shape[-1]
    x_BMI = x.reshape(rows, -1, math.prod(a_B.shape[1:-1]))
    h_BMR = jnp.einsum("bmi,bir->bmr", x_BMI, a_B.reshape(rows, -1, rank))
    y_BMO = jnp.einsum("bmr,bro->bmo", h_BMR, b_B.reshape(rows, rank, -1))
    return y_BMO.reshape(*x.shape[: x.ndim - n_in], *b_B.shape[2:])


# --------------------------------------------------------------------------- pure-dict params


def is_adapter(key) -> bool:
    return isinstance(key, str) and key.endswith(ADAPTER_SUFFIXES)


def _partition(tree: dict, keep_adapters: bool) -> dict:
    out = {}
    for k, v in tree.items():
        if isinstance(v, dict):
            sub = _partition(v, keep_adapters)
            if sub:
                out[k] = sub
        elif is_adapter(k) == keep_adapters:
            out[k] = v
    return out


def split(params: dict) -> tuple[dict, dict]:
    """(base, adapters): the pure-dict params without and with only the adapter leaves."""
    return _partition(params, False), _partition(params, True)


def join(base: dict, adapters: dict) -> dict:
    """The inverse of `split` (a new dict; the leaves are shared)."""
    out = dict(base)
    for k, v in adapters.items():
        out[k] = join(out.get(k, {}), v) if isinstance(v, dict) else v
    return out


def has_adapters(params: dict) -> bool:
    return bool(split(params)[1])


def merge(params: dict, lora: LoraConfig) -> dict:
    """Base params with every adapter folded in: `W + s A B` in `W`'s dtype (computed in f32),
    adapter leaves dropped. Jit it to run on the params' devices."""
    out = {}
    for k, v in params.items():
        if isinstance(v, dict):
            out[k] = merge(v, lora)
        elif is_adapter(k):
            continue
        elif k.endswith("_proj") and f"{k[:-5]}_lora_a" in params:
            a, b = params[f"{k[:-5]}_lora_a"], params[f"{k[:-5]}_lora_b"]
            update = lora.scale * jnp.tensordot(a.astype(jnp.float32), b.astype(jnp.float32), 1)
            out[k] = (v.astype(jnp.float32) + update).astype(v.dtype)
        else:
            out[k] = v
    return out


def zeros_like(adapters: dict) -> dict:
    """Adapters that change nothing (the reference policy of a LoRA run is its base)."""
    return jax.tree.map(jnp.zeros_like, adapters)


def count(params: dict) -> int:
    return sum(x.size for x in jax.tree.leaves(split(params)[1]))
