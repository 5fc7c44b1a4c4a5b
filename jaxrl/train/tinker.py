"""The Tinker SDK's training maths, pure (served by `jaxrl.service`): its built-in losses
(`forward_backward(data, loss_fn, loss_fn_config)`) and its `optim_step(AdamParams)` in optax.

Losses: `fn(logp_BT, inputs, cfg) -> loss_BT`, `logp_BT[b, t]` = log pi of `target_tokens[b, t]`
from the logits AT position t (targets come shifted: `jaxrl.train.logprobs.target_logprobs`);
`inputs`: the other `loss_fn_inputs`, [B, T] f32, all per token (`advantages` A too, unlike the
trainer's `algorithms`; `logprobs` = q, the sampler's); `cfg`: the `loss_fn_config` scalars.
They are SUMS: the caller masks `loss_BT` and sums it over tokens and datums (`loss:sum`), never
a mean (clients normalise through `weights` / `advantages`). `clip_low_threshold` /
`clip_high_threshold` (ppo, cispo) bound the ratio `r_t = exp(logp_t - q_t)` itself, not 1 -/+
eps. `LOSSES[name]` = (fn, required inputs besides `target_tokens`, optional inputs with their
default, config keys with their default).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logp_BT, inputs, cfg):
    """Weighted negative log-likelihood, `L_t = -w_t log pi(y_t)` (`weights` default to 1).
    With arbitrary float weights this is the linear surrogate the SDK's client-side custom
    losses send (`forward_backward_custom`)."""
    return -inputs["weights"] * logp_BT


def importance_sampling(logp_BT, inputs, cfg):
    """REINFORCE with an importance weight, `L_t = -r_t A_t`, whose gradient is
    `-r_t A_t grad log pi(y_t)`: q corrects for sampling with other weights (the off-policy
    policy gradient; Degris, White & Sutton 2012, "Off-Policy Actor-Critic")."""
    return -jnp.exp(logp_BT - inputs["logprobs"]) * inputs["advantages"]


def ppo(logp_BT, inputs, cfg):
    """PPO's clipped surrogate, `L_t = -min(r_t A_t, clip(r_t, low, high) A_t)`; `low` / `high`
    = `clip_low_threshold` / `clip_high_threshold`. Schulman et al. 2017, "Proximal Policy
    Optimization Algorithms" (arXiv:1707.06347), eq. 7."""
    r = jnp.exp(logp_BT - inputs["logprobs"])
    a = inputs["advantages"]
    clipped = jnp.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -jnp.minimum(r * a, clipped * a)


def cispo(logp_BT, inputs, cfg):
    """CISPO: a clipped, stop-gradient importance weight on the policy-gradient term,
    `L_t = -sg(clip(r_t, low, high)) A_t log pi(y_t)` (every token keeps its gradient).
    MiniMax 2025, "MiniMax-M1" (arXiv:2506.13585), eq. 4-5."""
    r = jnp.exp(logp_BT - inputs["logprobs"])
    w = jax.lax.stop_gradient(jnp.clip(r, cfg["clip_low_threshold"], cfg["clip_high_threshold"]))
    return -w * inputs["advantages"] * logp_BT


def gspo(logp_BT, inputs, cfg):
    """GSPO-token: every token's ratio takes its sequence's value, the geometric mean of the
    token ratios over the tokens M that `sequence_ratio_mask` marks, and its own log-prob's
    gradient: `s = exp(mean_{t in M}(log pi_t - q_t))`, `s_t = sg(s) pi_t / sg(pi_t)`,
    `L_t = -min(s_t A_t, clip(s_t, low, high) A_t)`. Zheng et al. 2025, "Group Sequence Policy
    Optimization" (arXiv:2507.18071), its GSPO-token objective, as Tinker's loss page states
    it. Without a `sequence_ratio_mask` (its default -1 marks "not sent"), M is the tokens with
    a non-zero advantage: the only ones the loss reads (a prompt token carries A = 0)."""
    mask = inputs["sequence_ratio_mask"]
    in_m_BT = jnp.where(mask < 0, inputs["advantages"] != 0, mask != 0).astype(logp_BT.dtype)
    log_ratio_BT = jax.lax.stop_gradient(logp_BT) - inputs["logprobs"]
    seq_B1 = (jnp.sum(log_ratio_BT * in_m_BT, axis=-1, keepdims=True)
              / jnp.maximum(jnp.sum(in_m_BT, axis=-1, keepdims=True), 1))
    s_BT = jnp.exp(seq_B1 + logp_BT - jax.lax.stop_gradient(logp_BT))
    a = inputs["advantages"]
    clipped = jnp.clip(s_BT, cfg["clip_low_threshold"], cfg["clip_high_threshold"])
    return -jnp.minimum(s_BT * a, clipped * a)


def dro(logp_BT, inputs, cfg):
    """DRO: policy gradient with a quadratic penalty on the log-ratio to the sampler,
    `L_t = -(log pi_t A_t - beta / 2 (log pi_t - q_t)^2)` (`beta`: `loss_fn_config`). Richemond
    et al. 2024, "Offline Regularised Reinforcement Learning for Large Language Models
    Alignment" (arXiv:2405.19107); Kimi Team 2025, "Kimi k1.5" (arXiv:2501.12599); as Tinker's
    loss page states it (the soft advantages are the client's). The penalty is on the sampled
    tokens only: a position with `q_t = 0` and `A_t = 0` is a prompt position (what the
    cookbook sends there, with no mask), where `(log pi_t - 0)^2` would pull the prompt's
    log-probabilities to 0 (docs/service.md)."""
    q, a = inputs["logprobs"], inputs["advantages"]
    sampled = (q != 0) | (a != 0)
    penalty = jnp.where(sampled, 0.5 * cfg["beta"] * jnp.square(logp_BT - q), 0.0)
    return -(logp_BT * a - penalty)


def stable_reinforce(logp_BT, inputs, cfg):
    """StableReinforce as this server defines it (Tinker publishes the name, the sampling-time
    records and the provenance, not the objective: docs/service.md says what was chosen and
    why): REINFORCE with a stop-gradient importance weight against the log-probabilities the
    SAMPLER recorded for the tokens it sampled, `q_t` (`recorded_logprobs`, filled by the server
    from the records that the datum's provenance names, never sent by the client), and tokens
    whose ratio left a trust band masked out:
    `r_t = exp(log pi_t - q_t)`, `w_t = sg(r_t) if low <= r_t <= high else 0`,
    `L_t = -m_t w_t A_t log pi_t`, with `m_t` 1 on positions a `SampledProvenanceSpan` covers
    (`sampled`; prompt positions: 0). On-policy (`r_t = 1`) its gradient is REINFORCE's; off
    policy each token is importance-corrected, and a token whose probability moved beyond the
    band (a stale sample, or sampler numerics that disagree with the trainer's) adds no
    gradient rather than a large one: the masked importance sampling of Ling Team 2025, "Every
    Step Evolves" (IcePop, arXiv:2510.18855), on REINFORCE (Williams 1992)."""
    r = jax.lax.stop_gradient(jnp.exp(logp_BT - inputs["recorded_logprobs"]))
    keep = (r >= cfg["clip_low_threshold"]) & (r <= cfg["clip_high_threshold"])
    w = jnp.where(keep, r, 0.0) * inputs["sampled"]
    return -w * inputs["advantages"] * logp_BT


# the SDK's documented config defaults for ppo / cispo; gspo's: the GSPO paper's clipping
# ranges (3e-4, 4e-4 around 1); dro's beta: the value Tinker's loss page shows;
# stable_reinforce's band: this server's choice (docs/service.md for all three)
_RL, _CLIP = ("logprobs", "advantages"), {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
LOSSES = {
    "cross_entropy": (cross_entropy, (), {"weights": 1.0}, {}),
    "importance_sampling": (importance_sampling, _RL, {}, {}),
    "ppo": (ppo, _RL, {}, _CLIP),
    "cispo": (cispo, _RL, {}, _CLIP),
    "gspo": (gspo, _RL, {"sequence_ratio_mask": -1.0},
             {"clip_low_threshold": 1 - 3e-4, "clip_high_threshold": 1 + 4e-4}),
    "dro": (dro, _RL, {}, {"beta": 0.05}),
    # recorded_logprobs / sampled: filled by the server from the datum's provenance
    # (jaxrl.service.stability), never sent; the band: within a factor 2 of the sampler's
    "stable_reinforce": (stable_reinforce, ("advantages", "recorded_logprobs", "sampled"), {},
                         {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}),
}
SERVER_INPUTS = {"stable_reinforce": ("recorded_logprobs", "sampled")}
# inputs a loss does not read that clients send anyway (tinker-cookbook builds one datum for
# every RL loss): accepted; any other unread input is refused, naming it
SENT_NOT_READ = {"stable_reinforce": ("logprobs",)}

# tinker.types.AdamParams' defaults (SDK 0.38): `ADAM`'s hyper-parameters, set per optim_step
ADAM_DEFAULTS = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0,
                     grad_clip_norm=0.0)


def _tinker_adam(learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm):
    """AdamW (decoupled weight decay; Loshchilov & Hutter 2019) after clipping by global norm
    (`grad_clip_norm` 0: none): `p -= lr (m_hat / (sqrt(v_hat) + eps) + wd p)`, `m_hat = m /
    (1 - beta1^k)`, `v_hat = v / (1 - beta2^k)` at the k-th step."""
    clip = jnp.where(grad_clip_norm > 0, grad_clip_norm, jnp.inf)
    return optax.chain(optax.clip_by_global_norm(clip),
                       optax.adamw(learning_rate, beta1, beta2, eps, weight_decay=weight_decay))


ADAM = optax.inject_hyperparams(_tinker_adam)(**ADAM_DEFAULTS)


def adam_state(params, mu=None, nu=None, steps: int = 0):
    """A fresh Adam state for `params`, or one resuming (copies of) saved moments after `steps`
    steps (Adam's count; `inject_hyperparams`' own count drives only schedules: none here)."""
    state = ADAM.init(params)
    if mu is None:
        return state
    adam = optax.ScaleByAdamState(jnp.asarray(steps, jnp.int32), *jax.tree.map(jnp.copy, (mu, nu)))
    return optax.tree_utils.tree_set(state, ScaleByAdamState=adam)


def adam_moments(state) -> tuple:  # (mu, nu) of an `adam_state`: what a save holds
    return optax.tree_utils.tree_get(state, "mu"), optax.tree_utils.tree_get(state, "nu")


@functools.partial(jax.jit, donate_argnums=(0, 2))
def adam_update(params, grads, state):
    """(params, state, global gradient norm before clipping) after one step with the
    hyper-parameters set in `state.hyperparams`."""
    updates, state = ADAM.update(grads, state, params)
    return optax.apply_updates(params, updates), state, optax.global_norm(grads)
