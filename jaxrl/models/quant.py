"""8-bit weights for the generator's copy of the model (`generate.quantize`): weight-only int8
(`"int8"`), int8 weights and activations (`"w8a8"`), or float8 e4m3 weights and activations
(`"fp8"`).

A projection `W` whose leading `n` axes are contracted (`q_proj [E, H, D]`: n=1, `o_proj
[H, D, E]`: n=2) is stored as `q = round(W / s)` in int8, clipped to [-127, 127], with one f32
scale per output channel, `s = max |W| / 127` over the contracted axes (symmetric, absmax). So
`|W - q s| <= s / 2` elementwise, and since the scale belongs to the output channel,
`x @ (q s) = (x @ q) s`: the matmul reads int8 weights and the scale multiplies the (small)
output instead of the (large) weight.

With `"w8a8"` (`generate.quantize="w8a8"`, CTranslate2's int8 scheme on CPU) each projection
also quantizes its input at run time, per token: `x = p t` with `t = max |x| / 127` over the
contracted axes of that token, and the contraction runs on int8 x int8 with int32 sums, `x @ (q s)
= (p @ q) t s` (exact in int32: a sum of K products of at most 127^2 overflows only past 133,000
terms). XLA's CPU backend has an int8 dot (1.1-1.9x faster than its f32 one at a decode step's
32 rows, but no faster than its bf16 one) and no mixed int8 x f32 one, so weight-only int8
converts the weight to f32 before each dot and is slower than f32 there. Inside a one-device CPU
engine's trace (`lowp_dots.cpu_kernels()`) each w8a8 projection is instead one custom call,
`jaxrl_kernels.cpu_w8a8_matmul` (AVX512-VNNI, 2.7-4.7x as fast as the XLA form at 32-128 rows),
whose results equal this module's XLA form bit for bit; accelerators keep the einsum.

`"fp8"` is w8a8 in float8 e4m3 (3 mantissa bits, largest finite value 448; the scheme of fp8
inference on GPUs with fp8 matmuls, e.g. Hopper's): the weight `q = W / s` with `s = max |W| /
448` per output channel, each token's input `p = x / t` with `t = max |x| / 448`, both rounded to
nearest even, so each channel's or token's largest value is exact and every other within
2^-4 of itself (relative; absolute 2^-10 times the scale below e4m3's normal range). The
contraction runs on the e4m3 operands with f32 sums, `x @ (q s) = (p @ q) t s`. XLA:CPU converts
both operands to f32 and runs its f32 dot (about f32's speed): there the format is for tests.

Only the decoder layers' projections are quantized; the embedding, a separate lm head, norms,
biases, routers and a mixture of experts' expert weights keep the generator's dtype (the
logits are the most sensitive to rounding, and the tied embedding is also a gather table).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import lowp_dots
from jaxrl_kernels import cpu_w8a8_matmul

INT8_MAX = 127
FP8_MAX = 448.0  # float8_e4m3fn's largest finite value
FORMATS = ("int8", "w8a8", "fp8")  # generate.quantize's values other than "none"
DYNAMIC = ("w8a8", "fp8")  # formats that also quantize each projection's input per token


def check_format(fmt: str) -> str:
    if fmt not in FORMATS:
        raise ValueError(f"quantize: invalid format {fmt!r}; valid choices: {list(FORMATS)}")
    return fmt


def _to_8bit(x32, amax, fp8: bool):
    """`(x32 / s, s)` in int8 (rounded, clipped to +-127) or float8 e4m3 (the cast rounds to
    nearest even; clipped to +-448 against f32 rounding of the division), `s = amax / max`;
    where `amax` is 0, `s` is 1."""
    top = FP8_MAX if fp8 else INT8_MAX
    s = jnp.where(amax > 0, amax / top, 1.0).astype(jnp.float32)
    x = x32 / s
    if fp8:
        return jnp.clip(x, -FP8_MAX, FP8_MAX).astype(jnp.float8_e4m3fn), s
    return jnp.clip(jnp.round(x), -INT8_MAX, INT8_MAX).astype(jnp.int8), s


def quantize_weight(w, n_contract: int, fmt: str = "int8"):
    """`(q, scale)`: `w` in int8 (`"int8"`, `"w8a8"`) or float8 e4m3 (`"fp8"`) with an f32
    scale per output channel (the axes after the first `n_contract`), `max |w|` over the
    contracted axes mapped to the format's largest value; `scale` has shape
    `w.shape[n_contract:]`. An all-zero channel gets scale 1 (its q is 0)."""
    w32 = w.astype(jnp.float32)
    amax = jnp.max(jnp.abs(w32), axis=tuple(range(n_contract)), keepdims=True)
    q, scale = _to_8bit(w32, amax, check_format(fmt) == "fp8")
    return q, scale.reshape(w.shape[n_contract:])


def _lead(scale, ndim: int):
    """`scale` with leading unit axes up to rank `ndim` (explicit broadcasting)."""
    return scale.reshape((1,) * (ndim - scale.ndim) + scale.shape)


def dequantize(q, scale, dtype=jnp.float32):
    """`q * scale` in `dtype` (`scale` broadcasts over the leading, contracted axes)."""
    return (q.astype(jnp.float32) * _lead(scale, q.ndim)).astype(dtype)


def quantized_einsum(spec: str, x, q, scale, fmt: str = "int8"):
    """`einsum(spec, x, dequantize(q, scale))` computed as `einsum(spec, x, q) * scale`, the
    per-output-channel scale applied to the result (whose trailing axes are the weight's output
    channels). `"int8"`: the weight is converted to `x`'s dtype inside the contraction (exact:
    |q| <= 127) and the products summed in f32. `"w8a8"`, `"fp8"`: `x` is quantized per token
    to the weight's format too (`quantize_activations`) and the contraction runs on the 8-bit
    operands, int8 with int32 sums or e4m3 with f32 sums."""
    if check_format(fmt) in DYNAMIC:
        return _dynamic_einsum(spec, x, q, scale, fmt)
    out = jnp.einsum(spec, x, q.astype(x.dtype), preferred_element_type=jnp.float32)
    return (out * _lead(scale, out.ndim)).astype(x.dtype)


def quantize_activations(x, n_contract: int, fmt: str = "w8a8"):
    """`(p, t)`: `x` in int8 (`"w8a8"`) or float8 e4m3 (`"fp8"`) with an f32 scale per token,
    `max |x|` over the last `n_contract` axes (the contracted ones) mapped to the format's
    largest value; `t` keeps those axes as unit axes. An all-zero token gets scale 1."""
    x32 = x.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x32), axis=tuple(range(x.ndim - n_contract, x.ndim)), keepdims=True)
    return _to_8bit(x32, amax, check_format(fmt) == "fp8")


def _dynamic_einsum(spec: str, x, q, scale, fmt: str):
    """`quantized_einsum` with `x` quantized per token. The spec's input must contract its
    trailing axes and keep the leading ones, in order, as the output's leading axes (every
    projection here: `bte,ef->btf`, `bthd,hde->bte`, ...), so the per-token scale broadcasts
    as is."""
    ins, out_axes = spec.split("->")
    x_axes, w_axes = ins.split(",")
    n = len([a for a in x_axes if a in w_axes and a not in out_axes])
    kept = x_axes[:len(x_axes) - n]
    if set(x_axes[len(kept):]) & set(out_axes) or not out_axes.startswith(kept):
        raise ValueError(f"{fmt} needs the input's contracted axes last and its other axes "
                         f"leading the output, in order; got {spec!r}")
    rows, contracted = x.shape[:len(kept)], x.shape[len(kept):]
    if _kernel_form(fmt, x, q, x_axes, w_axes, out_axes, kept):  # one CPU custom call, same numbers
        out = cpu_w8a8_matmul.w8a8_matmul(x.reshape(math.prod(rows), math.prod(contracted)),
                                          q.reshape(math.prod(contracted), -1), scale.reshape(-1))
        return out.reshape(rows + q.shape[n:])
    p, t = quantize_activations(x, n, fmt)
    sums = jnp.float32 if fmt == "fp8" else jnp.int32
    acc = jnp.einsum(spec, p, q, preferred_element_type=sums).astype(jnp.float32)
    t = t.reshape(t.shape[:len(kept)] + (1,) * (acc.ndim - len(kept)))
    return (acc * t * _lead(scale, acc.ndim)).astype(x.dtype)


def _kernel_form(fmt, x, q, x_axes, w_axes, out_axes, kept) -> bool:
    """Whether this w8a8 contraction runs as `jaxrl_kernels.cpu_w8a8_matmul` (inside a
    one-device CPU engine's trace, `lowp_dots.cpu_kernels()`): `x [rows, K] @ q [K, N]`, the
    weight's contracted axes leading in `x`'s order and its others trailing the output."""
    if fmt != "w8a8" or not lowp_dots.cpu_kernels():
        return False
    n = len(x_axes) - len(kept)
    if n == 0 or w_axes[:n] != x_axes[len(kept):] or out_axes != kept + w_axes[n:]:
        return False
    k, cols = math.prod(q.shape[:n]), math.prod(q.shape[n:])
    return cpu_w8a8_matmul.supports(k, cols, x.dtype) and cpu_w8a8_matmul.available()


def generator_state_fn(graphdef, out_shardings=None, *, quantize: str | None = "int8",
                       fuse: bool = False, dtype=None):
    """A jitted `params -> pure dict` of the generator's own copy: the plain model `graphdef`
    filled with `params` (a pure dict, as the weight sync moves them; floating leaves first cast
    to `dtype` unless None), its q/k/v and gate/up projections fused (`fuse`,
    `Transformer.fuse_projections`), then quantized to the format `quantize`
    (`Transformer.quantize`; None: not quantized). `out_shardings`: the transformed model's
    (None: where XLA puts them, on the devices of `params`)."""
    def cast(x):
        return x.astype(dtype) if jnp.issubdtype(x.dtype, jnp.floating) else x

    def transform(params):
        if dtype is not None:
            params = jax.tree.map(cast, params)
        model = nnx.merge(graphdef, params)
        if fuse:
            model.fuse_projections()
        if quantize is not None:
            model.quantize(quantize)
        return nnx.state(model).to_pure_dict()

    return jax.jit(transform, out_shardings=out_shardings)


def quantized_copy(model, fmt: str = "int8"):
    """A copy of a `Transformer` quantized to `fmt` (the original keeps its weights): for
    benchmarks, tests and offline sampling; a run's publish uses `generator_state_fn`."""
    copy = nnx.merge(*nnx.split(model))
    return copy.quantize(fmt)
