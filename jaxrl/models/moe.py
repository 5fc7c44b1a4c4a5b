"""The mixture-of-experts MLP of Qwen3-MoE: a softmax router, top-k, and dropless experts.

Each token goes to the `k` experts of highest router probability (`softmax` in f32, then top-k,
renormalised over the k when `norm_topk_prob`, as HF's `Qwen3MoeTopKRouter`); its output is the
probability-weighted sum of those experts' SwiGLU MLPs. Nothing is dropped: no capacity factor,
every (token, expert) pair is computed.

The expert computation is a grouped matmul: the N*k (token, expert) pairs are sorted by expert,
and `jax.lax.ragged_dot` multiplies each contiguous group of rows by its own expert's weights
(`group_sizes` = tokens per expert). One kernel call per projection, whatever the routing, and
no [N, X, F] one-hot dispatch tensor; see docs/design.md for why this path.

Routing replay: `__call__(..., experts_NK=...)` uses the given expert indices instead of the
router's top-k; the combine weights are still the router's probabilities *of those experts*, so
the router keeps its gradient (Ma et al. 2025, "Stabilizing MoE Reinforcement Learning by Aligning
Training and Inference Routers", arXiv:2510.11370, R3: replay the inference routing mask, recompute
the gate weights from the training router's logits).

Shape suffixes: N tokens, E embed, F expert intermediate, X experts, K experts per token.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.config import ModelConfig

EXPERT_AXIS = "expert"


def route(logits_NX, k: int, norm_topk_prob: bool, experts_NK=None):
    """`(weights_NK f32, experts_NK int32)`: the top-k experts of each token and their combine
    weights; with `experts_NK` given, those experts (replay) weighted by the router. A replayed
    row holding a negative index (a token the generator did not route: the last sampled token,
    padding) takes the router's own top-k."""
    probs_NX = jax.nn.softmax(logits_NX.astype(jnp.float32), axis=-1)
    weights_NK, own_NK = jax.lax.top_k(probs_NX, k)
    if experts_NK is None:
        experts_NK = own_NK
    else:
        given_N1 = jnp.all(experts_NK >= 0, axis=-1, keepdims=True)
        experts_NK = jnp.where(given_N1, experts_NK.astype(jnp.int32), own_NK)
        weights_NK = jnp.take_along_axis(probs_NX, experts_NK, axis=-1)
    if norm_topk_prob:
        weights_NK = weights_NK / jnp.sum(weights_NK, axis=-1, keepdims=True)
    return weights_NK, experts_NK.astype(jnp.int32)


def load_balancing_loss(logits_NX, experts_NK, mask_N=None):
    """Switch Transformer's auxiliary loss (Fedus et al. 2021, arXiv:2101.03961, eqs. 4-6):
    `X * sum_x f_x P_x`, with f_x the number of a token's k slots that go to expert x and P_x
    the router probability of x, each averaged over the tokens of `mask_N` (all by default); k
    when the load is uniform. As HF's `load_balancing_loss_func` for one layer."""
    x = logits_NX.shape[-1]
    probs_NX = jax.nn.softmax(logits_NX.astype(jnp.float32), axis=-1)
    mask_N = jnp.ones(probs_NX.shape[:1], jnp.float32) if mask_N is None else mask_N
    mask_N = mask_N.astype(jnp.float32)
    rows = jnp.maximum(jnp.sum(mask_N), 1.0)
    onehot_NX = jnp.sum(jax.nn.one_hot(experts_NK, x, dtype=jnp.float32), axis=1)
    f_X = jnp.sum(onehot_NX * mask_N[:, None], axis=0) / rows
    p_X = jnp.sum(probs_NX * mask_N[:, None], axis=0) / rows
    return x * jnp.sum(f_X * p_X)


def grouped_swiglu(x_NE, weights_NK, experts_NK, w_gate_XEF, w_up_XEF, w_down_XFE):
    """`sum_k weights[n, k] * MLP_{experts[n, k]}(x[n])` by sorting the N*K pairs by expert and
    one `ragged_dot` per projection."""
    n, k = experts_NK.shape
    num_experts = w_gate_XEF.shape[0]
    flat_M = experts_NK.reshape(-1)  # M = N*K (token, slot) pairs, token-major
    order_M = jnp.argsort(flat_M, stable=True)
    group_sizes_X = jnp.bincount(flat_M, length=num_experts).astype(jnp.int32)
    x_ME = x_NE[order_M // k]
    gate_MF = jax.lax.ragged_dot(x_ME, w_gate_XEF, group_sizes_X)
    up_MF = jax.lax.ragged_dot(x_ME, w_up_XEF, group_sizes_X)
    h_MF = jax.nn.silu(gate_MF) * up_MF
    y_ME = jax.lax.ragged_dot(h_MF, w_down_XFE, group_sizes_X)
    y_NKE = y_ME[jnp.argsort(order_M)].reshape(n, k, -1)  # back to token-major order
    # combine in f32, like HF's index_add_ of weight * expert output
    out_NE = jnp.einsum("nke,nk->ne", y_NKE.astype(jnp.float32), weights_NK)
    return out_NE.astype(x_NE.dtype)


class MoE(nnx.Module):
    """The sparse MLP block (HF `Qwen3MoeSparseMoeBlock`): `router` `[E, X]`, expert weights
    stacked along a leading `expert` axis."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, param):
        e, f, x = cfg.hidden_size, cfg.expert_size, cfg.num_experts
        self.router = param(rngs, (e, x), ("embed", None), 0.02)
        self.gate_proj = param(rngs, (x, e, f), (EXPERT_AXIS, "embed", "mlp"), 0.02)
        self.up_proj = param(rngs, (x, e, f), (EXPERT_AXIS, "embed", "mlp"), 0.02)
        self.down_proj = param(rngs, (x, f, e), (EXPERT_AXIS, "mlp", "embed"), 0.02)
        self.k = cfg.experts_per_token
        self.norm_topk_prob = cfg.norm_topk_prob

    def add_lora(self, rngs: nnx.Rngs) -> None:
        """No adapters on experts (ModelConfig refuses MLP targets for a mixture of experts)."""

    def router_logits(self, x_BTE):
        """`[B*T, X]` router logits in the activation dtype (as HF's `F.linear`)."""
        x_NE = x_BTE.reshape(-1, x_BTE.shape[-1])
        return x_NE @ self.router[...].astype(x_BTE.dtype)

    def __call__(self, x_BTE, experts_BTK=None):
        """`(out_BTE, logits_NX, experts_NK)`; `experts_BTK`: replay these experts."""
        dt = x_BTE.dtype
        logits_NX = self.router_logits(x_BTE)
        replay = None if experts_BTK is None else experts_BTK.reshape(-1, self.k)
        weights_NK, experts_NK = route(logits_NX, self.k, self.norm_topk_prob, replay)
        w = (self.gate_proj[...], self.up_proj[...], self.down_proj[...])
        out_NE = grouped_swiglu(x_BTE.reshape(-1, x_BTE.shape[-1]), weights_NK, experts_NK,
                                *(p.astype(dt) for p in w))
        return out_NE.reshape(x_BTE.shape), logits_NX, experts_NK


def num_sparse_layers(cfg: ModelConfig) -> int:
    """How many layers are mixtures of experts (Ls: the leading axis of routing records)."""
    return sum(cfg.is_sparse_layer(i) for i in range(cfg.num_layers))


def experts_dtype(num_experts: int):
    """The smallest integer dtype that holds expert indices and the -1 of "not recorded"
    (int8 up to 127 experts, else int16): routing records are [layers, tokens, k] of it."""
    return jnp.int8 if num_experts <= 127 else jnp.int16


def routing_mismatch(used_LNK, recorded_LNK, valid_N):
    """`(pair_frac, token_frac)`: the fraction of (sparse layer, token) pairs, and of tokens in
    any sparse layer, whose top-k expert *set* differs between `used` and `recorded`, over the
    tokens of `valid_N` that have a recording (no negative index). Order within the k is
    ignored."""
    used = jnp.sort(used_LNK.astype(jnp.int32), axis=-1)
    rec = jnp.sort(recorded_LNK.astype(jnp.int32), axis=-1)
    valid_N = valid_N & jnp.all(recorded_LNK >= 0, axis=(0, 2))
    differ_LN = jnp.any(used != rec, axis=-1) & valid_N[None]
    n = jnp.maximum(jnp.sum(valid_N), 1).astype(jnp.float32)
    pair = jnp.sum(differ_LN) / (n * used.shape[0])
    token = jnp.sum(jnp.any(differ_LN, axis=0)) / n
    return pair.astype(jnp.float32), token.astype(jnp.float32)
