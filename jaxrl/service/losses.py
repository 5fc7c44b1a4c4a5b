"""The Tinker SDK's built-in losses as pure functions of per-token log-probabilities.

Each takes `logp_BT` (log pi_theta of `target_tokens`, f32), the datum inputs padded to `[B, T]`
(`inputs`), the loss config (`cfg`, scalars) and returns the per-token loss `[B, T]`; the server
multiplies by the padding mask and **sums** (Tinker's losses are sums over tokens and datums, not
means: the caller scales through `weights` / `advantages`). Notation: `q` = the sampler's
log-probability (`inputs["logprobs"]`), `A` = `inputs["advantages"]`, `r = exp(logp - q)`.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

# config defaults (the SDK documents these keys for ppo / cispo)
CLIP_LOW, CLIP_HIGH = 0.8, 1.2


def cross_entropy(logp_BT, inputs, cfg):
    """Weighted negative log-likelihood: `-w_t log pi(y_t)` (`weights` default to 1). With
    arbitrary float weights this is the linear surrogate the SDK's client-side custom losses
    send (`forward_backward_custom`)."""
    return -inputs["weights"] * logp_BT


def importance_sampling(logp_BT, inputs, cfg):
    """REINFORCE with an importance weight: `-r_t A_t`, whose gradient is `-r_t A_t grad logp_t`
    (the sampler's `q` corrects for sampling with other weights)."""
    return -jnp.exp(logp_BT - inputs["logprobs"]) * inputs["advantages"]


def ppo(logp_BT, inputs, cfg):
    """PPO's clipped surrogate (Schulman et al. 2017, arXiv:1707.06347):
    `-min(r_t A_t, clip(r_t, low, high) A_t)`, `low`/`high` = `clip_low_threshold` /
    `clip_high_threshold` (default 0.8 / 1.2)."""
    r = jnp.exp(logp_BT - inputs["logprobs"])
    a = inputs["advantages"]
    clipped = jnp.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -jnp.minimum(r * a, clipped * a)


def cispo(logp_BT, inputs, cfg):
    """CISPO (MiniMax-M1, arXiv:2506.13585): a clipped, stop-gradient importance weight on the
    policy-gradient term, `-sg(clip(r_t, low, high)) A_t logp_t`."""
    r = jnp.exp(logp_BT - inputs["logprobs"])
    w = jax.lax.stop_gradient(jnp.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"]))
    return -w * inputs["advantages"] * logp_BT


# name -> (fn, required float inputs besides target_tokens, optional inputs with their default,
#          config keys with their default)
LOSSES = {
    "cross_entropy": (cross_entropy, (), {"weights": 1.0}, {}),
    "importance_sampling": (importance_sampling, ("logprobs", "advantages"), {}, {}),
    "ppo": (ppo, ("logprobs", "advantages"), {},
            {"clip_low_threshold": CLIP_LOW, "clip_high_threshold": CLIP_HIGH}),
    "cispo": (cispo, ("logprobs", "advantages"), {},
              {"clip_low_threshold": CLIP_LOW, "clip_high_threshold": CLIP_HIGH}),
}
