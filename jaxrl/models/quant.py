"""Weight-only int8 for the generator's copy of the model (`generate.quantize="int8"`).

A projection `W` whose leading `n` axes are contracted (`q_proj [E, H, D]`: n=1, `o_proj
[H, D, E]`: n=2) is stored as `q = round(W / s)` in int8, clipped to [-127, 127], with one f32
scale per output channel, `s = max |W| / 127` over the contracted axes (symmetric, absmax). So
`|W - q s| <= s / 2` elementwise, and since the scale belongs to the output channel,
`x @ (q s) = (x @ q) s`: the matmul reads int8 weights and the scale multiplies the (small)
output instead of the (large) weight.

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


def int8_einsum(spec: str, x, q, scale):
    """`einsum(spec, x, dequantize(q, scale))` computed as `einsum(spec, x, q) * scale`: the
    int8 weight is converted to `x`'s dtype inside the contraction (exact: |q| <= 127), the
    products summed in f32, and the per-output-channel scale applied to the result, whose
    trailing axes are the weight's output channels."""
    out = jnp.einsum(spec, x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (out * _lead(scale, out.ndim)).astype(x.dtype)


def generator_state_fn(graphdef, out_shardings=None, *, int8: bool = True, fuse: bool = False):
    """A jitted `params -> pure dict` of the generator's own copy: the plain model `graphdef`
    filled with `params` (a pure dict, as the weight sync moves them), its q/k/v and gate/up
    projections fused (`fuse`, `Transformer.fuse_projections`), then quantized (`int8`,
    `Transformer.quantize_int8`). `out_shardings`: the transformed model's (generator mesh)."""
    from flax import nnx

    def transform(params):
        model = nnx.merge(graphdef, params)
        if fuse:
            model.fuse_projections()
        if int8:
            model.quantize_int8()
        return nnx.state(model).to_pure_dict()

    return jax.jit(transform, out_shardings=out_shardings)


def int8_copy(model):
    """A quantized copy of a `Transformer` (the original keeps its weights): for benchmarks,
    tests and offline sampling; a run's publish uses `generator_state_fn`."""
    from flax import nnx

    copy = nnx.merge(*nnx.split(model))
    copy.quantize_int8()
    return copy
