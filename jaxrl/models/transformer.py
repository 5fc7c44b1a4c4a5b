"""A decoder-only transformer for the Llama / Qwen2 / Qwen3 / Gemma 2 / Gemma 3 families and
Qwen3-MoE, in Flax NNX.

RMSNorm, rotary embeddings (theta, optional Llama-3 or linear frequency scaling), grouped-query
attention, SwiGLU MLP, optional QKV bias (Qwen2), optional per-head q/k RMSNorm (Qwen3), tied or
untied embeddings; the sparse layers of a mixture of experts use `jaxrl.models.moe.MoE`.
Sliding-window layers (`ModelConfig.layer_window`: Mistral, OLMo 3, Gemma) mask their attention
to the window.
Gemma 2 / 3 (`GEMMA_ARCHITECTURES`): embeddings scaled by sqrt(E), RMSNorm by (1 + w), sandwich
norms around both sublayers, GeGLU (tanh GELU), scores scaled by `query_pre_attn_scalar**-0.5`,
attention and final logits soft-capped (Gemma 2), a separate rope base for the sliding layers
(Gemma 3). Every parameter carries `logical_axes` metadata; `jaxrl.sharding` maps them to a mesh.

Shape suffixes: B batch, T query length, S key length, E embed, H query heads, K kv heads,
D head dim, F mlp, V vocab, L layers.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import ModelConfig
from jaxrl.config.sections import GEMMA_ARCHITECTURES
from jaxrl.models import lora, lowp_dots
from jaxrl.models.attention import attention, soft_cap
from jaxrl.models.kv_cache import DTYPES, KVCache
from jaxrl.models.moe import MoE
from jaxrl.models.projections import SPECS, check_fusable, project, quantize_projections
from jaxrl.models.remat import remat_call
from jaxrl.models.swiglu import swiglu

__all__ = ["DTYPES", "KVCache", "Transformer", "rope_tables"]


def _param(rngs: nnx.Rngs, shape, axes, dtype, std: float | None = None, ones=False):
    if ones:
        value = jnp.ones(shape, dtype)
    elif std is None:
        value = jnp.zeros(shape, dtype)
    else:
        value = (std * jax.random.truncated_normal(rngs.params(), -2.0, 2.0, shape)).astype(dtype)
    return nnx.Param(value, logical_axes=axes)


class RMSNorm(nnx.Module):
    """RMSNorm over the last axis, or over the last two when `dim` is a pair (OLMo 2's q/k norm
    over all heads of a projection together: `dim=(heads, head_dim)`). `offset` (Gemma): the
    scale is `1 + weight`, the weight starting at 0."""

    def __init__(self, dim: int | tuple[int, int], eps: float, axis_name: str | tuple,
                 param_dtype, rngs: nnx.Rngs, offset: bool = False):
        shape, axes = (dim, axis_name) if isinstance(dim, tuple) else ((dim,), (axis_name,))
        self.weight = _param(rngs, shape, axes, param_dtype, ones=not offset)
        self.eps = eps
        self.offset = offset

    def __call__(self, x):
        w = self.weight[...].astype(jnp.float32) + (1.0 if self.offset else 0.0)
        x32 = x.astype(jnp.float32)
        mean_sq = jnp.mean(x32 * x32, axis=tuple(range(-w.ndim, 0)), keepdims=True)
        w = w.reshape((1,) * (x.ndim - w.ndim) + w.shape)
        return (x32 * jax.lax.rsqrt(mean_sq + self.eps) * w).astype(x.dtype)


# architectures whose sliding layers take no rope scaling (transformers' rope parameters per
# layer type: `rope_scaling` is the full-attention layers')
_SCALED_FULL_LAYERS_ONLY = ("gemma3", "olmo3")


def rope_frequencies(cfg: ModelConfig, theta: float | None = None):
    """Inverse frequencies `[D/2]` for base `theta` (default `cfg.rope_theta`), with the
    configured scaling (`cfg.rope_scaling`: Llama 3's or linear) when `theta` is None (not for
    a separate local base)."""
    d = cfg.head_size
    base = cfg.rope_theta if theta is None else theta
    inv_freq = 1.0 / (base ** (jnp.arange(0, d, 2, dtype=jnp.float32) / d))
    rs = cfg.rope_scaling
    if rs is None or theta is not None:
        return inv_freq
    if rs.rope_type == "linear":  # position p rotates as p / factor (Gemma 3 4B+)
        return inv_freq / rs.factor
    # Llama 3.1: long wavelengths are divided by `factor`, short ones kept, the band between
    # interpolated linearly in 1/wavelength.
    low_wavelen = rs.original_max_position_embeddings / rs.low_freq_factor
    high_wavelen = rs.original_max_position_embeddings / rs.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = jnp.where(wavelen > low_wavelen, inv_freq / rs.factor, inv_freq)
    smooth = (rs.original_max_position_embeddings / wavelen - rs.low_freq_factor) / (
        rs.high_freq_factor - rs.low_freq_factor
    )
    mid = (1 - smooth) * scaled / rs.factor + smooth * scaled
    in_band = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return jnp.where(in_band, mid, scaled)


def local_rope_theta(cfg: ModelConfig) -> float | None:
    """The sliding layers' own rope base when their rotation differs from the full layers':
    `cfg.rope_local_theta` (Gemma 3), or the one base unscaled when the full layers' is scaled
    and the architecture scales those only (`_SCALED_FULL_LAYERS_ONLY`). None: one set."""
    if cfg.rope_local_theta is not None:
        return cfg.rope_local_theta
    if (cfg.rope_scaling is not None and cfg.architecture in _SCALED_FULL_LAYERS_ONLY
            and any(cfg.layer_window(i) is not None for i in range(cfg.num_layers))):
        return cfg.rope_theta
    return None


def rope_tables(cfg: ModelConfig, positions_BT):
    """`(cos, sin)`, each `[B, T, 1, D/2]` f32: the rotation of every position, computed once per
    forward and shared by every layer's q and k. When the sliding layers rotate otherwise
    (`local_rope_theta`: their own base, Gemma 3, or no scaling): `{"full": (cos, sin),
    "local": (cos, sin)}`, each layer taking its own (`layer_rope`)."""
    def tables(theta):
        freqs = rope_frequencies(cfg, theta)[None, None]
        angles_BTF = positions_BT[..., None].astype(jnp.float32) * freqs
        return jnp.cos(angles_BTF)[:, :, None, :], jnp.sin(angles_BTF)[:, :, None, :]

    local = local_rope_theta(cfg)
    if local is None:
        return tables(None)
    return {"full": tables(None), "local": tables(local)}


def prompt_rope_tables(cfg: ModelConfig, length: int):
    """`rope_tables` of positions `0 .. length - 1` (one row, broadcast over a batch), computed
    now, so a traced step holds them as constants: computed inside a step, XLA:CPU fuses cos and
    sin into every head's rotation and evaluates them once per head (~10% of a CPU prefill)."""
    with jax.ensure_compile_time_eval():
        return rope_tables(cfg, jnp.arange(length)[None, :])


def table_rope(cfg: ModelConfig, positions_BT, max_len: int):
    """`rope_tables(cfg, positions_BT)` read from the tables of every position below `max_len`:
    inside a decode loop those are loop-invariant (XLA hoists them out, to be computed once per
    call), so a step gathers rows instead of evaluating cos and sin in every head's rotation.
    The price is `max_len x D/2` evaluations a call, against `steps x rows x heads x layers x
    D/2` in the steps: a one-step call with a very long `max_len` would pay more."""
    tables = rope_tables(cfg, jnp.arange(max_len)[None, :])
    return jax.tree.map(lambda t: t[0][positions_BT], tables)


def layer_rope(rope, window: int | None):
    """The rotation tables a layer uses: the local ones for a sliding layer when `rope_tables`
    made two sets."""
    if not isinstance(rope, dict):
        return rope
    return rope["full" if window is None else "local"]


def apply_rope(x_BTHD, rope):
    """Rotate pairs (i, i + D/2) by angle position * inv_freq[i] (the HF "rotate_half" layout);
    `rope` = `rope_tables(cfg, positions)`."""
    cos, sin = rope
    x1, x2 = jnp.split(x_BTHD.astype(jnp.float32), 2, axis=-1)
    out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
    return out.astype(x_BTHD.dtype)


class Attention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, window: int | None = None):
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        pd = DTYPES[cfg.param_dtype]
        std = 0.02
        self.cfg = cfg
        self.window = window  # sliding window of this layer (None: full causal attention)
        scalar = cfg.query_pre_attn_scalar
        # a tuple, not a dict: a graphdef must stay hashable (it keys the jitted steps' caches)
        self.options = (("window", window), ("softcap", cfg.attn_logit_softcap),
                        ("scale", None if scalar is None else scalar ** -0.5))
        self.quant_format = None  # quantize(fmt) swaps the projections for 8-bit values + scales
        self.fused = False  # fuse_projections() joins q/k/v into qkv_proj
        self.out_in = False  # lowp_dots.hold_out_in: weights held output axes first
        self.q_proj = _param(rngs, (e, h, d), ("embed", "heads", "head_dim"), pd, std)
        self.k_proj = _param(rngs, (e, k, d), ("embed", "kv_heads", "head_dim"), pd, std)
        self.v_proj = _param(rngs, (e, k, d), ("embed", "kv_heads", "head_dim"), pd, std)
        self.o_proj = _param(rngs, (h, d, e), ("heads", "head_dim", "embed"), pd, std)
        if cfg.qkv_bias:
            self.q_bias = _param(rngs, (h, d), ("heads", "head_dim"), pd)
            self.k_bias = _param(rngs, (k, d), ("kv_heads", "head_dim"), pd)
            self.v_bias = _param(rngs, (k, d), ("kv_heads", "head_dim"), pd)
        if cfg.o_bias:
            self.o_bias = _param(rngs, (e,), ("embed",), pd)
        if cfg.qk_norm and cfg.qk_norm_full:  # OLMo 2: over all heads of the projection
            self.q_norm = RMSNorm((h, d), cfg.rms_norm_eps, ("heads", "head_dim"), pd, rngs)
            self.k_norm = RMSNorm((k, d), cfg.rms_norm_eps, ("kv_heads", "head_dim"), pd, rngs)
        elif cfg.qk_norm:  # Qwen3, Gemma 3: per head
            gemma = cfg.architecture in GEMMA_ARCHITECTURES
            self.q_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", pd, rngs, offset=gemma)
            self.k_norm = RMSNorm(d, cfg.rms_norm_eps, "head_dim", pd, rngs, offset=gemma)

    def add_lora(self, rngs: nnx.Rngs) -> None:
        cfg = self.cfg
        e, h, k, d = cfg.hidden_size, cfg.num_heads, cfg.num_kv_heads, cfg.head_size
        for name, n, axis in (("q", h, "heads"), ("k", k, "kv_heads"), ("v", k, "kv_heads")):
            lora.add_adapters(self, cfg.lora, name, (e,), ("embed",), (n, d), (axis, "head_dim"),
                              rngs)
        lora.add_adapters(self, cfg.lora, "o", (h, d), ("heads", "head_dim"), (e,), ("embed",),
                          rngs)

    def quantize(self, fmt: str) -> None:
        """Hold q/k/v/o in the 8-bit `fmt` with per-output-channel scales (`jaxrl.models.quant`)."""
        inputs = {"qkv_proj": 1} if self.fused else {"q_proj": 1, "k_proj": 1, "v_proj": 1}
        quantize_projections(self, {**inputs, "o_proj": 2}, fmt)

    def fuse_projections(self) -> None:
        """Join q/k/v (and their biases) into one `qkv_proj [E, K, G+2, D]` (G = H/K query heads
        per kv head): per kv head, its G query heads, then its key, then its value, so one dot
        computes all three and a `kv_heads` shard holds whole groups. Inference only."""
        check_fusable(self, self.cfg.lora.enabled)
        h, k = self.cfg.num_heads, self.cfg.num_kv_heads

        def join(q, k_, v, axis):  # q [..., H, D] -> [..., K, G, D]; k, v [..., K, 1, D]
            q = q.reshape(*q.shape[:axis], k, h // k, q.shape[-1])
            return jnp.concatenate([q, jnp.stack([k_, v], axis=axis + 1)], axis=axis + 1)

        qkv = join(self.q_proj[...], self.k_proj[...], self.v_proj[...], 1)
        self.qkv_proj = nnx.Param(qkv, logical_axes=("embed", "kv_heads", None, "head_dim"))
        del self.q_proj, self.k_proj, self.v_proj
        if self.cfg.qkv_bias:
            qkv = join(self.q_bias[...], self.k_bias[...], self.v_bias[...], 0)
            self.qkv_bias = nnx.Param(qkv, logical_axes=("kv_heads", None, "head_dim"))
            del self.q_bias, self.k_bias, self.v_bias
        self.fused = True

    def _fused_qkv(self, x_BTE):
        """q, k, v from the one `qkv_proj` dot (`fuse_projections`)."""
        dt = x_BTE.dtype
        out_BTKGD = project(self, "qkv_proj", x_BTE, dt)
        if self.cfg.qkv_bias:
            out_BTKGD = out_BTKGD + self.qkv_bias[...].astype(dt)[None, None]
        b, t, _, g2, d = out_BTKGD.shape
        q = out_BTKGD[:, :, :, : g2 - 2].reshape(b, t, self.cfg.num_heads, d)
        return q, out_BTKGD[:, :, :, g2 - 2], out_BTKGD[:, :, :, g2 - 1]

    def _qkv(self, x_BTE, rope):
        dt, ad = x_BTE.dtype, self.cfg.lora
        if self.fused:
            q, k, v = self._fused_qkv(x_BTE)
            if self.cfg.qk_norm:
                q, k = self.q_norm(q), self.k_norm(k)
            return apply_rope(q, rope), apply_rope(k, rope), v
        q = project(self, "q_proj", x_BTE, dt)
        k = project(self, "k_proj", x_BTE, dt)
        v = project(self, "v_proj", x_BTE, dt)
        if ad.enabled:
            q = q + lora.delta(self, ad, "q", x_BTE, 1)
            k = k + lora.delta(self, ad, "k", x_BTE, 1)
            v = v + lora.delta(self, ad, "v", x_BTE, 1)
        if self.cfg.qkv_bias:
            q = q + self.q_bias[...].astype(dt)[None, None]
            k = k + self.k_bias[...].astype(dt)[None, None]
            v = v + self.v_bias[...].astype(dt)[None, None]
        if self.cfg.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        return apply_rope(q, rope), apply_rope(k, rope), v

    def __call__(self, x_BTE, rope, segment_ids_BT):
        q, k, v = self._qkv(x_BTE, rope)
        out_BTHD = attention(q, k, v, segment_ids_BT=segment_ids_BT, impl=self.cfg.attention_impl,
                             **dict(self.options))
        return self._out(out_BTHD, x_BTE.dtype)

    def _out(self, out_BTHD, dt):
        out_BTE = project(self, "o_proj", out_BTHD, dt)
        if self.cfg.lora.enabled:
            out_BTE = out_BTE + lora.delta(self, self.cfg.lora, "o", out_BTHD.astype(dt), 2)
        if self.cfg.o_bias:
            out_BTE = out_BTE + self.o_bias[...].astype(dt)[None, None]
        return out_BTE

    def decode(self, x_BTE, rope, attend):
        """`attend(q, k, v, **options) -> (out_BTHD, layer_cache)` writes the new k/v into a
        cache and attends to it (a bound `write_and_attend` of the cache in use) with this
        layer's window, soft-cap and scale."""
        q, k, v = self._qkv(x_BTE, rope)
        out_BTHD, layer_cache = attend(q, k, v, **dict(self.options))
        return self._out(out_BTHD, x_BTE.dtype), layer_cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        e, f, pd = cfg.hidden_size, cfg.intermediate_size, DTYPES[cfg.param_dtype]
        self.gate_proj = _param(rngs, (e, f), ("embed", "mlp"), pd, 0.02)
        self.up_proj = _param(rngs, (e, f), ("embed", "mlp"), pd, 0.02)
        self.down_proj = _param(rngs, (f, e), ("mlp", "embed"), pd, 0.02)
        self.lora = cfg.lora
        self.sizes = (e, f)
        # GeGLU (Gemma: tanh-approximate GELU) or SwiGLU
        self.gelu = cfg.architecture in GEMMA_ARCHITECTURES
        self.quant_format = None  # quantize(fmt) swaps the projections for 8-bit values + scales
        self.fused = False  # fuse_projections() joins gate/up into gate_up_proj
        self.out_in = False  # lowp_dots.hold_out_in: weights held output axes first

    def add_lora(self, rngs: nnx.Rngs) -> None:
        e, f = self.sizes
        for name in ("gate", "up"):
            lora.add_adapters(self, self.lora, name, (e,), ("embed",), (f,), ("mlp",), rngs)
        lora.add_adapters(self, self.lora, "down", (f,), ("mlp",), (e,), ("embed",), rngs)

    def quantize(self, fmt: str) -> None:
        """Hold gate/up/down in the 8-bit `fmt` with per-output-channel scales
        (`jaxrl.models.quant`)."""
        inputs = {"gate_up_proj": 1} if self.fused else {"gate_proj": 1, "up_proj": 1}
        quantize_projections(self, {**inputs, "down_proj": 1}, fmt)

    def fuse_projections(self) -> None:
        """Join gate and up into one `gate_up_proj [E, 2, F]` (one dot for both; an `mlp` shard
        holds both halves of its slice). Inference only."""
        check_fusable(self, bool(self.lora.enabled))
        gate_up = jnp.stack([self.gate_proj[...], self.up_proj[...]], axis=1)
        self.gate_up_proj = nnx.Param(gate_up, logical_axes=("embed", None, "mlp"))
        del self.gate_proj, self.up_proj
        self.fused = True

    def __call__(self, x_BTE):
        dt = x_BTE.dtype
        if self.fused:
            gate_up_BT2F = project(self, "gate_up_proj", x_BTE, dt)
            h_BTF = self._act(gate_up_BT2F[:, :, 0]) * gate_up_BT2F[:, :, 1]
            return project(self, "down_proj", h_BTF, dt)
        adapted = any(t in ("gate", "up", "down") for t in self.lora.targets) and self.lora.rank
        if not adapted and self.quant_format is None and not self.gelu and not self.out_in:
            w = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
            return swiglu(x_BTE, *(p.astype(dt) for p in w))
        # with adapters, 8-bit weights or GeGLU: the plain expression (autodiff; the base
        # weights of adapters and 8-bit weights get no gradient)
        gate_BTF = project(self, "gate_proj", x_BTE, dt)
        up_BTF = project(self, "up_proj", x_BTE, dt)
        if adapted:
            gate_BTF = gate_BTF + lora.delta(self, self.lora, "gate", x_BTE, 1)
            up_BTF = up_BTF + lora.delta(self, self.lora, "up", x_BTE, 1)
        h_BTF = lowp_dots.gated(self._act, gate_BTF, up_BTF)
        out_BTE = project(self, "down_proj", h_BTF, dt)
        if adapted:
            out_BTE = out_BTE + lora.delta(self, self.lora, "down", h_BTF, 1)
        return out_BTE


    def _act(self, x):
        return jax.nn.gelu(x, approximate=True) if self.gelu else jax.nn.silu(x)


class DecoderLayer(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, index: int = 0):
        pd = DTYPES[cfg.param_dtype]
        # pre-norm (Llama): norm -> sublayer -> add; post-norm (OLMo 2): sublayer -> norm -> add,
        # `post_attn_norm` then normalising the attention's output, `post_mlp_norm` the MLP's;
        # sandwich (Gemma): norm -> sublayer -> norm -> add, `pre_mlp_norm` the MLP's input
        self.sandwich = cfg.architecture in GEMMA_ARCHITECTURES
        self.post_norm = cfg.post_norm or self.sandwich  # the sublayers' outputs normed
        norm = lambda: RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "norm", pd, rngs,
                               offset=self.sandwich)
        if self.post_norm:
            self.post_mlp_norm = norm()
        self.pre_norm = not cfg.post_norm  # the sublayers' inputs normed
        if self.pre_norm:
            self.input_norm = norm()
        if self.sandwich:
            self.pre_mlp_norm = norm()
        self.attn = Attention(cfg, rngs, cfg.layer_window(index))
        self.post_attn_norm = norm()
        self.sparse = cfg.is_sparse_layer(index)
        if self.sparse:
            self.mlp = MoE(cfg, rngs, lambda r, shape, axes, std: _param(r, shape, axes, pd, std))
        else:
            self.mlp = MLP(cfg, rngs)

    def _mlp(self, x_BTE, experts_BTK):
        """The residual MLP; `(x_BTE, routing)`, routing `(logits_NX, experts_NK)` of a sparse
        layer (None for a dense one)."""
        if self.sandwich:
            h_BTE = self.pre_mlp_norm(x_BTE)
        else:
            h_BTE = x_BTE if self.post_norm else self.post_attn_norm(x_BTE)
        if not self.sparse:
            out_BTE, routing = self.mlp(h_BTE), None
        else:
            out_BTE, logits_NX, experts_NK = self.mlp(h_BTE, experts_BTK)
            routing = (logits_NX, experts_NK)
        return x_BTE + (self.post_mlp_norm(out_BTE) if self.post_norm else out_BTE), routing

    def attn_in(self, x_BTE):
        """The attention's input (normed first in a pre-norm layer)."""
        return self.input_norm(x_BTE) if self.pre_norm else x_BTE

    def attn_out(self, h_BTE):
        """What the attention adds to the residual (normed first in a post-norm layer)."""
        return self.post_attn_norm(h_BTE) if self.post_norm else h_BTE

    def __call__(self, x_BTE, rope, segment_ids_BT, experts_BTK=None):
        """`rope`: `rope_tables` of the model (this layer takes its own set: `layer_rope`)."""
        rope = layer_rope(rope, self.attn.window)
        x_BTE = x_BTE + self.attn_out(self.attn(self.attn_in(x_BTE), rope, segment_ids_BT))
        return self._mlp(x_BTE, experts_BTK)

    def decode(self, x_BTE, rope, attend):
        rope = layer_rope(rope, self.attn.window)
        h, layer_cache = self.attn.decode(self.attn_in(x_BTE), rope, attend)
        x_BTE, routing = self._mlp(x_BTE + self.attn_out(h), None)
        return x_BTE, layer_cache, routing


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Routing:
    """The routing of a mixture of experts' sparse layers, stacked in layer order (Ls of them):
    router logits `[Ls, N, X]` (N = B*T tokens) and the chosen experts `[Ls, B, T, K]`."""

    logits_LNX: jax.Array
    experts_LBTK: jax.Array


def _stack_routing(routings, shape_BT) -> Routing | None:
    routings = [r for r in routings if r is not None]
    if not routings:
        return None
    return Routing(logits_LNX=jnp.stack([lg for lg, _ in routings]),
                   experts_LBTK=jnp.stack([e.reshape(*shape_BT, -1) for _, e in routings]))


class Transformer(nnx.Module):
    """`model(tokens_BT, positions_BT=None, segment_ids_BT=None) -> logits_BTV` (float32)."""

    def __init__(self, cfg: ModelConfig, *, rngs: nnx.Rngs):
        pd = DTYPES[cfg.param_dtype]
        self.cfg = cfg
        self.embed = _param(rngs, (cfg.vocab_size, cfg.hidden_size), ("vocab", "embed"), pd, 0.02)
        self.layers = nnx.List([DecoderLayer(cfg, rngs, i) for i in range(cfg.num_layers)])
        self.final_norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps, "norm", pd, rngs,
                                  offset=cfg.architecture in GEMMA_ARCHITECTURES)
        if not cfg.tie_embeddings:
            self.lm_head = _param(
                rngs, (cfg.hidden_size, cfg.vocab_size), ("embed", "vocab"), pd, 0.02
            )
        if cfg.lora.enabled:  # drawn last: the base weights equal those of the plain model
            adapter_rngs = nnx.Rngs(rngs.params())
            for layer in self.layers:
                layer.attn.add_lora(adapter_rngs)
                layer.mlp.add_lora(adapter_rngs)

    def quantize(self, fmt: str = "int8") -> Transformer:
        """The generator's 8-bit copy (`generate.quantize`, `jaxrl.models.quant`), in place:
        every decoder layer's attention and dense MLP projections become int8 (`"int8"`,
        `"w8a8"`) or float8 e4m3 (`"fp8"`) with f32 scales per output channel. The embedding,
        lm head, norms, biases and expert weights keep their dtype. `"w8a8"`: those projections
        also quantize their inputs per token and contract in int8. Inference only: the 8-bit
        weights have no gradient."""
        for layer in self.layers:
            layer.attn.quantize(fmt)
            if not layer.sparse:
                layer.mlp.quantize(fmt)
        return self

    def fuse_projections(self) -> Transformer:
        """The generator's fused copy (`generate.fuse_projections`): in every decoder layer, q/k/v
        become one projection and a dense MLP's gate/up another, in place (one wider dot each
        instead of three and two). Call before `quantize`; refused with LoRA adapters.
        Inference only; checkpoints and HF export read the unfused layout."""
        for layer in self.layers:
            layer.attn.fuse_projections()
            if not layer.sparse:
                layer.mlp.fuse_projections()
        return self

    def hold_out_in(self) -> Transformer:
        """The copy a `JaxEngine` on CPU devices decodes with (2-byte weights): every decoder
        layer's dense projections held output axes first, contracted axes last, in place
        (`lowp_dots.hold_out_in`; 8-bit ones keep their layout). Inference only."""
        if self.cfg.lora.enabled:
            raise ValueError("hold_out_in: the model has LoRA adapters, which read the base "
                             "projections in their own layout")
        for layer in self.layers:
            for module in (layer.attn,) if layer.sparse else (layer.attn, layer.mlp):
                if module.quant_format is None and not module.out_in:
                    lowp_dots.hold_out_in(module, {n: SPECS[n] for n in SPECS
                                                   if hasattr(module, n)})
        return self

    def _embed(self, tokens_BT):
        x_BTE = lowp_dots.take_rows(self.embed[...], tokens_BT)
        if self.cfg.architecture in GEMMA_ARCHITECTURES:  # the scale rounded to the weights' dtype
            x_BTE = x_BTE * jnp.asarray(self.cfg.hidden_size ** 0.5, x_BTE.dtype)
        return x_BTE.astype(DTYPES[self.cfg.dtype])

    def hidden(self, tokens_BT, positions_BT=None, segment_ids_BT=None, rope=None):
        """Final-normed hidden states `[B, T, E]` (feed `logits` in chunks to save memory).

        `rope`: `rope_tables(cfg, positions_BT)` computed by the caller, e.g. once outside a loop
        over micro-batches (inside the loop body, XLA's CPU backend fuses cos/sin into every
        rotation and re-evaluates them per head); by default computed here."""
        return self.hidden_routed(tokens_BT, positions_BT, segment_ids_BT, rope)[0]

    def hidden_routed(self, tokens_BT, positions_BT=None, segment_ids_BT=None, rope=None,
                      experts_LBTK=None):
        """`(h_BTE, routing)`: `hidden` and the `Routing` of the sparse layers (None for a dense
        model). `experts_LBTK`: replay these experts in the sparse layers (routing replay) instead
        of the router's top-k; the router still weights them (`jaxrl.models.moe`)."""
        if positions_BT is None:
            positions_BT = jnp.broadcast_to(jnp.arange(tokens_BT.shape[1]), tokens_BT.shape)
        if rope is None:
            rope = rope_tables(self.cfg, positions_BT)
        x_BTE = self._embed(tokens_BT)
        routings, s = [], 0
        for layer in self.layers:
            experts_BTK = None
            if layer.sparse and experts_LBTK is not None:
                experts_BTK, s = experts_LBTK[s], s + 1
            if self.cfg.remat:
                x_BTE, routing = remat_call(layer, x_BTE, rope, segment_ids_BT, experts_BTK)
            else:
                x_BTE, routing = layer(x_BTE, rope, segment_ids_BT, experts_BTK)
            routings.append(routing)
        return self.final_norm(x_BTE), _stack_routing(routings, tokens_BT.shape)

    def head_weight(self, dtype) -> jax.Array:
        """The lm head as `[E, V]` in `dtype` (the embedding, transposed, when tied)."""
        if self.cfg.tie_embeddings:
            return self.embed[...].astype(dtype).T
        return self.lm_head[...].astype(dtype)

    def logits(self, h_BTE, *, vocab_major: bool = False):
        """Project hidden states to float32 vocabulary logits (soft-capped by
        `cfg.final_logit_softcap`, Gemma 2); `vocab_major`: as `[V, B, T]` (read in place only
        by a generator on CPU with a tied lm head; otherwise transposed)."""
        if self.cfg.tie_embeddings and lowp_dots.active():  # a generator on CPU
            logits = lowp_dots.table_logits(h_BTE, self.embed[...], vocab_major=vocab_major)
            return soft_cap(logits, self.cfg.final_logit_softcap)
        if vocab_major:
            return jnp.transpose(self.logits(h_BTE), (2, 0, 1))
        w_EV = self.head_weight(h_BTE.dtype)
        logits_BTV = jnp.einsum("bte,ev->btv", h_BTE, w_EV, preferred_element_type=jnp.float32)
        return soft_cap(logits_BTV, self.cfg.final_logit_softcap)

    def __call__(self, tokens_BT, positions_BT=None, segment_ids_BT=None):
        return self.logits(self.hidden(tokens_BT, positions_BT, segment_ids_BT))

    def decode_hidden(self, tokens_BT, cache: KVCache, num_valid_B=None):
        """`decode_hidden_routed` without the routing: `(h_BTE, new_cache)`."""
        h_BTE, new_cache, _ = self.decode_hidden_routed(tokens_BT, cache, num_valid_B)
        return h_BTE, new_cache

    def decode_hidden_routed(self, tokens_BT, cache: KVCache, num_valid_B=None, rope=None):
        """Append T tokens per row to the cache at each row's current length.

        Returns `(h_BTE, new_cache, experts_LBTK)` with final-normed hidden states (project the
        positions you need with `logits`) and the experts each sparse layer chose for each token
        (int32 `[Ls, B, T, K]`; None for a dense model): what routing replay records. Row b's
        tokens get positions `lengths[b] + t`; only the first `num_valid_B[b]` (default T)
        count towards the new length — the rest are padding that later writes overwrite. Used
        for prompt prefill into a slot and for one-token decode steps.
        The caller guarantees `lengths + T <= max_len` (writes past the end would be clamped).
        `cache` is a `KVCache` or a `jaxrl.models.paged.PagedKVCache`: anything with
        `lengths_B`, `write_and_attend` and `with_layers`. `rope`: the tokens' `rope_tables`,
        when the caller has them (by default computed here from the positions).
        """
        t = tokens_BT.shape[1]
        lengths_B = cache.lengths_B
        new_lengths_B = lengths_B + (t if num_valid_B is None else num_valid_B)
        positions_BT = lengths_B[:, None] + jnp.arange(t)[None, :]
        if rope is None:
            rope = rope_tables(self.cfg, positions_BT)
        x_BTE = self._embed(tokens_BT)
        layer_caches, routings = [], []
        for i, layer in enumerate(self.layers):
            attend = functools.partial(cache.write_and_attend, i, positions_BT=positions_BT,
                                       kv_lengths_B=lengths_B + t, impl=self.cfg.attention_impl)
            x_BTE, layer_cache, routing = layer.decode(x_BTE, rope, attend)
            layer_caches.append(layer_cache)
            routings.append(routing)
        new_cache = cache.with_layers(layer_caches, new_lengths_B.astype(jnp.int32))
        routing = _stack_routing(routings, tokens_BT.shape)
        experts_LBTK = None if routing is None else routing.experts_LBTK
        return self.final_norm(x_BTE), new_cache, experts_LBTK

    def decode(self, tokens_BT, cache: KVCache, num_valid_B=None):
        """`decode_hidden` followed by the vocabulary projection: `(logits_BTV, new_cache)`."""
        h_BTE, cache = self.decode_hidden(tokens_BT, cache, num_valid_B)
        return self.logits(h_BTE), cache
