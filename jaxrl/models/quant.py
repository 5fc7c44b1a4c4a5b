"""Int8 for the generator's copy of the model: weight-only (`generate.quantize="int8"`) or w8a8.

A projection `W` whose leading `n` axes are contracted (`q_proj [E, H, D]`: n=1, `o_proj
[H, D, E]`: n=2) is stored as `q = round(W / s)` in int8, clipped to [-127, 127], with one f32
scale per output channel, `s = max |W| / 127` over the contracted axes (symmetric, absmax). So
`|W - q s| <= s / 2` elementwise, and since the scale belongs to the output channel,
`x @ (q s) = (x @ q) s`: the matmul reads int8 weights and the scale multiplies the (small)
output instead of the (large) weight.

With `activations` (`generate.quantize="w8a8"`, CTranslate2's int8 scheme on CPU) each projection
also quantizes its input at run time, per token: `x = p t` with `t = max |x| / 127` over the
contracted axes of that token, and the contraction runs on int8 x int8 with int32 sums, `x @ (q s)
= (p @ q) t s` (exact in int32: a sum of K products of at most 127^2 overflows only past 133,000
terms). XLA's CPU backend has an int8 dot (measured 1.1-1.9x faster than the f32 one at a
decode step's 32 rows) but no mixed int8 x f32 one, so weight-only int8 converts the weight to
f32 before each dot and is slower than f32 there; accelerators gain from either.

Only the decoder layers' projections are quantized; the embedding, a separate lm head, norms,
biases, routers and a mixture of experts' expert weights keep the generator's dtype (the
logits are the most sensitive to rounding, and the tied embedding is also a gather table).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

INT8_MAX = 127


def quantize_int8(w, n_contract: int):
    """`(q, scale)`: `w` in int8 with an f32 scale per output channel (the axes after the
    first `n_contract`); `scale` has shape `w.shape[n_contract:]`. An all-zero channel gets
    scale 1 (its q is 0)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(n_contract)))
    scale = jnp.where(amax > 0, amax / INT8_MAX, 1.0).astype(jnp.float32)
    q = jnp.clip(jnp.round(w32 / _lead(scale, w.ndim)), -INT8_MAX, INT8_MAX).astype(jnp.int8)
    return q, scale


def _lead(scale, ndim: int):
    """`scale` with leading unit axes up to rank `ndim` (explicit broadcasting)."""
    return scale.reshape((1,) * (ndim - scale.ndim) + scale.shape)


def dequantize(q, scale, dtype=jnp.float32):
    """`q * scale` in `dtype` (`scale` broadcasts over the leading, contracted axes)."""
    return (q.astype(jnp.float32) * _lead(scale, q.ndim)).astype(dtype)


def int8_einsum(spec: str, x, q, scale, *, activations: bool = False):
    """`einsum(spec, x, dequantize(q, scale))` computed as `einsum(spec, x, q) * scale`: the
    int8 weight is converted to `x`'s dtype inside the contraction (exact: |q| <= 127), the
    products summed in f32, and the per-output-channel scale applied to the result, whose
    trailing axes are the weight's output channels. `activations`: `x` is quantized per token
    too (`quantize_activations`) and the contraction runs in int8 with int32 sums."""
    if activations:
        return _w8a8_einsum(spec, x, q, scale)
    out = jnp.einsum(spec, x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (out * _lead(scale, out.ndim)).astype(x.dtype)


def quantize_activations(x, n_contract: int):
    """`(p, t)`: `x` in int8 with an f32 scale per token, `t = max |x| / 127` over the last
    `n_contract` axes (the contracted ones); `t` keeps them as unit axes. An all-zero token gets
    scale 1."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=tuple(range(x.ndim - n_contract, x.ndim)), keepdims=True)
    t = jnp.where(amax > 0, amax / INT8_MAX, 1.0)
    return jnp.clip(jnp.round(x32 / t), -INT8_MAX, INT8_MAX).astype(jnp.int8), t


def _w8a8_einsum(spec: str, x, q, scale):
    """`int8_einsum` with `x` quantized per token. The spec's input must contract its trailing
    axes and keep the leading ones, in order, as the output's leading axes (every projection
    here: `bte,ef->btf`, `bthd,hde->bte`, ...), so the per-token scale broadcasts as is."""
    ins, out_axes = spec.split("->")
    x_axes, w_axes = ins.split(",")
    n = len([a for a in x_axes if a in w_axes and a not in out_axes])
    kept = x_axes[:len(x_axes) - n]
    if set(x_axes[len(kept):]) & set(out_axes) or not out_axes.startswith(kept):
        raise ValueError(f"w8a8 needs the input's contracted axes last and its other axes "
                         f"leading the output, in order; got {spec!r}")
    p, t = quantize_activations(x, n)
    acc = jnp.einsum(spec, p, q, preferred_element_type=jnp.int32).astype(jnp.float32)
    t = t.reshape(t.shape[:len(kept)] + (1,) * (acc.ndim - len(kept)))
    return (acc * t * _lead(scale, acc.ndim)).astype(x.dtype)


def generator_state_fn(graphdef, out_shardings=None, *, int8: bool = True, fuse: bool = False,
                       activations: bool = False):
    """A jitted `params -> pure dict` of the generator's own copy: the plain model `graphdef`
    filled with `params` (a pure dict, as the weight sync moves them), its q/k/v and gate/up
    projections fused (`fuse`, `Transformer.fuse_projections`), then quantized (`int8`,
    `Transformer.quantize_int8`, per-token int8 activations with `activations`).
    `out_shardings`: the transformed model's (generator mesh)."""
    from flax import nnx

    def transform(params):
        model = nnx.merge(graphdef, params)
        if fuse:
            model.fuse_projections()
        if int8:
            model.quantize_int8(activations=activations)
        return nnx.state(model).to_pure_dict()

    return jax.jit(transform, out_shardings=out_shardings)


def int8_copy(model, *, activations: bool = False):
    """A quantized copy of a `Transformer` (the original keeps its weights; `activations`:
    w8a8): for benchmarks, tests and offline sampling; a run's publish uses
    `generator_state_fn`."""
    from flax import nnx

    copy = nnx.merge(*nnx.split(model))
    copy.quantize_int8(activations=activations)
    return copy
