"""RL maths for the trainer: pure, registered functions over arrays and masks.

Every function here is pure jnp (no model, no config objects), so it is tested in milliseconds and
composes under `jit`, `grad` and `vmap`. Functions are registered by name and picked by the config
strings in `jaxrl.train.config.TrainConfig`; the valid names live in the registries below
(`ADVANTAGES`, `POLICY_LOSSES`, `AGGREGATIONS`, `KL_ESTIMATORS`, `CORRECTIONS`).

Shape suffixes: B = sequences, T = tokens. Conventions shared by all functions:

* `logp_BT[b, t]` is log pi(tokens[b, t] | tokens[b, :t]) -- the log-probability of the token AT
  position t, predicted from the logits at position t-1. Position 0 is never a target.
* `mask_BT` is 1.0 on completion tokens that carry loss (0 on prompt, padding, position 0). Masked
  tokens contribute nothing to any loss, gradient or statistic.
* `old_logp_BT` is the "proximal" policy of PPO (the trainer's own logprobs at the parameters
  that started this update); `behav_logp_BT` is the generator's behaviour policy mu.
* Statistics are masked means unless the key ends in `_max` (a masked max).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import jax
import jax.numpy as jnp

Array = jax.Array
Stats = dict[str, Array]

# log-ratios are clipped before exp so a wild token cannot make inf/nan (e^20 ~ 5e8).
_MAX_LOG_RATIO = 20.0


class Registry:
    """Name -> function table (plus what each entry declares about itself, `meta`); an unknown
    name fails listing the valid ones."""

    def __init__(self, kind: str):
        self.kind = kind
        self._fns: dict[str, Callable[..., Any]] = {}
        self._meta: dict[str, dict[str, Any]] = {}

    def register(self, name: str, **meta: Any) -> Callable[[Callable[..., Any]],
                                                             Callable[..., Any]]:
        def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
            if name in self._fns:
                raise ValueError(f"{self.kind} {name!r} registered twice")
            self._fns[name] = fn
            self._meta[name] = dict(meta)
            return fn

        return deco

    def meta(self, name: str) -> dict[str, Any]:
        self.get(name)  # the error for an unknown name
        return self._meta[name]

    def get(self, name: str) -> Callable[..., Any]:
        if name not in self._fns:
            raise ValueError(f"unknown {self.kind} {name!r}; valid names: {self.names()}")
        return self._fns[name]

    def names(self) -> tuple[str, ...]:
        return tuple(sorted(self._fns))


ADVANTAGES = Registry("advantage estimator")
POLICY_LOSSES = Registry("policy loss")
AGGREGATIONS = Registry("loss aggregation")
KL_ESTIMATORS = Registry("KL estimator")
# An off-policy correction declares what it `needs` in the batch ("behaviour": the generator's
# logprobs; "proximal": pi_old recomputed by the trainer) and its `scope`: "batch" corrections
# (e.g. a batch-global mask) run once on the full batch before the micro-batch loop,
# "micro_batch" ones inside each micro-batch's loss, "none" not at all.
CORRECTIONS = Registry("off-policy correction")


# ----------------------------------------------------------------------------- helpers


def masked_sum(x: Array, mask: Array) -> Array:
    return jnp.sum(jnp.where(mask > 0, x, 0.0))


def masked_mean(x: Array, mask: Array) -> Array:
    """Mean of x over mask > 0 (0 when the mask is empty)."""
    return masked_sum(x, mask) / jnp.maximum(jnp.sum(mask > 0), 1)


def masked_max(x: Array, mask: Array) -> Array:
    return jnp.max(jnp.where(mask > 0, x, -jnp.inf), initial=0.0)


def _exp_ratio(log_ratio: Array) -> Array:
    return jnp.exp(jnp.clip(log_ratio, -_MAX_LOG_RATIO, _MAX_LOG_RATIO))


def _group_stats(
    rewards_B: Array, group_ids_B: Array, valid_B: Array
) -> tuple[Array, Array, Array]:
    """Per-sequence (group mean, group sum of squared deviations, group size) of valid rows."""
    n = rewards_B.shape[0]
    v_B = valid_B.astype(rewards_B.dtype)
    r_B = rewards_B * v_B
    size_G = jax.ops.segment_sum(v_B, group_ids_B, num_segments=n)
    sum_G = jax.ops.segment_sum(r_B, group_ids_B, num_segments=n)
    mean_G = sum_G / jnp.maximum(size_G, 1.0)
    mean_B = mean_G[group_ids_B]
    sq_G = jax.ops.segment_sum(jnp.square(rewards_B - mean_B) * v_B, group_ids_B, num_segments=n)
    return mean_B, sq_G[group_ids_B], size_G[group_ids_B]


# ----------------------------------------------------------------------------- advantages
# Signature: fn(rewards_B, group_ids_B, valid_B, *, eps) -> advantages_B.
# group_ids_B are ints in [0, B); rows with the same id form a group (the G samples of one prompt).
# Rows with valid_B == 0 (padding) get advantage 0 and do not enter any group statistic.


@ADVANTAGES.register("grpo")
def grpo_advantages(rewards_B: Array, group_ids_B: Array, valid_B: Array, *, eps: float) -> Array:
    """A_i = (r_i - mean_group(r)) / (std_group(r) + eps).

    Shao et al. 2024, "DeepSeekMath" (GRPO), eq. for outcome supervision. std is the unbiased
    sample std (ddof=1, as TRL and verl compute it); a group of one has advantage 0.
    """
    mean_B, sq_B, size_B = _group_stats(rewards_B, group_ids_B, valid_B)
    std_B = jnp.sqrt(sq_B / jnp.maximum(size_B - 1.0, 1.0))
    return jnp.where(valid_B > 0, (rewards_B - mean_B) / (std_B + eps), 0.0)


@ADVANTAGES.register("drgrpo")
def drgrpo_advantages(rewards_B: Array, group_ids_B: Array, valid_B: Array, *, eps: float) -> Array:
    """A_i = r_i - mean_group(r)  (no std normalisation).

    Liu et al. 2025, "Understanding R1-Zero-Like Training: A Critical Perspective" (Dr. GRPO).
    `eps` is unused (kept for a uniform signature).
    """
    del eps
    mean_B, _, _ = _group_stats(rewards_B, group_ids_B, valid_B)
    return jnp.where(valid_B > 0, rewards_B - mean_B, 0.0)


@ADVANTAGES.register("rloo")
def rloo_advantages(rewards_B: Array, group_ids_B: Array, valid_B: Array, *, eps: float) -> Array:
    """A_i = r_i - 1/(G-1) * sum_{j != i} r_j  =  G/(G-1) * (r_i - mean_group(r)).

    Leave-one-out baseline: Kool et al. 2019, "Buy 4 REINFORCE Samples, Get a Baseline for Free!";
    Ahmadian et al. 2024, "Back to Basics: Revisiting REINFORCE Style Optimization" (RLOO).
    A group of one has advantage 0. `eps` is unused.
    """
    del eps
    mean_B, _, size_B = _group_stats(rewards_B, group_ids_B, valid_B)
    scale_B = size_B / jnp.maximum(size_B - 1.0, 1.0)
    return jnp.where((valid_B > 0) & (size_B > 1), scale_B * (rewards_B - mean_B), 0.0)


def overlong_penalty(lengths_B: Array, *, max_len: int, cache_len: int) -> Array:
    """DAPO soft overlong punishment, counted in completion tokens |y|:

        R(y) = 0                                   if |y| <= L_max - L_cache
             = ((L_max - L_cache) - |y|) / L_cache  if L_max - L_cache < |y| <= L_max
             = -1                                  if |y| > L_max

    Yu et al. 2025, "DAPO: An Open-Source LLM Reinforcement Learning System at Scale", eq. 13.
    Added to the task reward before advantages are computed.
    """
    if cache_len <= 0 or cache_len > max_len:
        raise ValueError(f"overlong cache_len must be in (0, max_len={max_len}]; got {cache_len}")
    l_B = lengths_B.astype(jnp.float32)
    soft = float(max_len - cache_len)
    pen_B = (soft - l_B) / cache_len
    return jnp.where(l_B <= soft, 0.0, jnp.where(l_B <= max_len, pen_B, -1.0))


# ----------------------------------------------------------------------------- policy losses
# Signature: fn(logp_BT, old_logp_BT, adv_B, mask_BT, *, eps_low, eps_high, dual_clip)
#   -> (loss_BT, stats). loss_BT is the per-token loss (to be aggregated); gradient flows only
#   through logp_BT. dual_clip = 0 disables dual clipping.


@POLICY_LOSSES.register("ppo_clip")
def ppo_clip_loss(
    logp_BT: Array,
    old_logp_BT: Array,
    adv_B: Array,
    mask_BT: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
) -> tuple[Array, Stats]:
    """Clipped surrogate with decoupled clip range ("clip-higher") and optional dual clip.

        r_t   = pi(y_t) / pi_old(y_t)
        L_t   = max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high))
        dual  : if A < 0, L_t = min(L_t, -c A)   (c = dual_clip > 1)

    Schulman et al. 2017, "Proximal Policy Optimization Algorithms"; clip-higher from DAPO (Yu et
    al. 2025); dual clip from Ye et al. 2020, "Mastering Complex Control in MOBA Games with Deep
    RL".
    """
    adv_BT = adv_B[:, None]
    log_ratio_BT = logp_BT - old_logp_BT
    ratio_BT = _exp_ratio(log_ratio_BT)
    pg1_BT = -adv_BT * ratio_BT
    pg2_BT = -adv_BT * jnp.clip(ratio_BT, 1.0 - eps_low, 1.0 + eps_high)
    loss_BT = jnp.maximum(pg1_BT, pg2_BT)
    stats = {"clip_frac": masked_mean((pg2_BT > pg1_BT).astype(jnp.float32), mask_BT)}
    if dual_clip > 0:
        if dual_clip <= 1:
            raise ValueError(f"dual_clip must be > 1 (or 0 = off); got {dual_clip}")
        capped_BT = jnp.minimum(loss_BT, -dual_clip * adv_BT)
        dual_BT = (adv_BT < 0) & (capped_BT < loss_BT)
        loss_BT = jnp.where(adv_BT < 0, capped_BT, loss_BT)
        stats["dual_clip_frac"] = masked_mean(dual_BT.astype(jnp.float32), mask_BT)
    stats["approx_kl"] = masked_mean(k3(logp_BT, old_logp_BT), mask_BT)
    return jnp.where(mask_BT > 0, loss_BT, 0.0), stats


@POLICY_LOSSES.register("gspo")
def gspo_loss(
    logp_BT: Array,
    old_logp_BT: Array,
    adv_B: Array,
    mask_BT: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
) -> tuple[Array, Stats]:
    """Sequence-level clipped ratio (GSPO), in its token form.

        s_i   = exp( 1/|y_i| sum_t log(pi(y_it) / pi_old(y_it)) )      (length-normalised)
        s_it  = sg(s_i) * pi(y_it) / sg(pi(y_it))                       (value s_i, grad per token)
        L_it  = max(-A_i s_it, -A_i clip(s_it, 1 - eps_low, 1 + eps_high))

    Zheng et al. 2025, "Group Sequence Policy Optimization" (eq. 5-7, GSPO-token). The paper uses
    small ranges (eps ~ 3e-4 / 4e-4). With `seq_mean_token_mean` aggregation this is exactly the
    sequence-level objective. dual_clip is not defined for GSPO and must be 0.
    """
    if dual_clip:
        raise ValueError("gspo does not support dual_clip; set dual_clip=0")
    m_BT = (mask_BT > 0).astype(logp_BT.dtype)
    len_B = jnp.maximum(jnp.sum(m_BT, axis=-1), 1.0)
    seq_log_ratio_B = jnp.sum((logp_BT - old_logp_BT) * m_BT, axis=-1) / len_B
    s_B = _exp_ratio(seq_log_ratio_B)
    s_BT = jax.lax.stop_gradient(s_B)[:, None] * jnp.exp(logp_BT - jax.lax.stop_gradient(logp_BT))
    adv_BT = adv_B[:, None]
    pg1_BT = -adv_BT * s_BT
    pg2_BT = -adv_BT * jnp.clip(s_BT, 1.0 - eps_low, 1.0 + eps_high)
    loss_BT = jnp.maximum(pg1_BT, pg2_BT)
    stats = {
        "clip_frac": masked_mean((pg2_BT > pg1_BT).astype(jnp.float32), mask_BT),
        "approx_kl": masked_mean(k3(logp_BT, old_logp_BT), mask_BT),
    }
    return jnp.where(mask_BT > 0, loss_BT, 0.0), stats


@POLICY_LOSSES.register("cispo")
def cispo_loss(
    logp_BT: Array,
    old_logp_BT: Array,
    adv_B: Array,
    mask_BT: Array,
    *,
    eps_low: float,
    eps_high: float,
    dual_clip: float = 0.0,
) -> tuple[Array, Stats]:
    """Clipped IS-weight policy gradient (CISPO): the weight is clipped, never the gradient.

        r_t  = pi(y_t) / pi_old(y_t)
        L_t  = -sg(clip(r_t, 1 - eps_low, 1 + eps_high)) * A * log pi(y_t)

    MiniMax 2025, "MiniMax-M1: Scaling Test-Time Compute Efficiently with Lightning Attention"
    (eq. 4-5). The paper leaves the lower bound open (set eps_low >= 1). dual_clip must be 0.
    """
    if dual_clip:
        raise ValueError("cispo does not support dual_clip; set dual_clip=0")
    ratio_BT = _exp_ratio(logp_BT - old_logp_BT)
    clipped_BT = jnp.clip(ratio_BT, 1.0 - eps_low, 1.0 + eps_high)
    loss_BT = -jax.lax.stop_gradient(clipped_BT) * adv_B[:, None] * logp_BT
    stats = {
        "clip_frac": masked_mean((clipped_BT != ratio_BT).astype(jnp.float32), mask_BT),
        "approx_kl": masked_mean(k3(logp_BT, old_logp_BT), mask_BT),
    }
    return jnp.where(mask_BT > 0, loss_BT, 0.0), stats


# ----------------------------------------------------------------------------- aggregation
# Signature: fn(loss_BT, mask_BT, *, num_tokens, num_seqs, norm_len) -> scalar.
# num_tokens / num_seqs are the counts of the WHOLE batch (loss tokens; sequences with at least one
# loss token), so summing the value over micro-batches gives exactly the full-batch loss.


def batch_counts(mask_BT: Array) -> tuple[Array, Array]:
    """(number of loss tokens, number of sequences with >= 1 loss token) -- the normalisers."""
    m_BT = mask_BT > 0
    return jnp.sum(m_BT).astype(jnp.float32), jnp.sum(jnp.any(m_BT, axis=-1)).astype(jnp.float32)


@AGGREGATIONS.register("token_mean")
def token_mean(loss_BT: Array, mask_BT: Array, *, num_tokens, num_seqs, norm_len) -> Array:
    """L = sum_{i,t} m_it l_it / sum_{i,t} m_it   -- every token weighs the same.

    Yu et al. 2025, "DAPO" (token-level policy gradient loss)."""
    del num_seqs, norm_len
    return masked_sum(loss_BT, mask_BT) / jnp.maximum(num_tokens, 1.0)


@AGGREGATIONS.register("seq_mean_token_mean")
def seq_mean_token_mean(loss_BT: Array, mask_BT: Array, *, num_tokens, num_seqs, norm_len) -> Array:
    """L = 1/N sum_i ( sum_t m_it l_it / |y_i| )  -- every sequence weighs the same.

    Shao et al. 2024, "DeepSeekMath" (original GRPO objective, eq. 3)."""
    del num_tokens, norm_len
    m_BT = (mask_BT > 0).astype(loss_BT.dtype)
    per_seq_B = jnp.sum(loss_BT * m_BT, axis=-1) / jnp.maximum(jnp.sum(m_BT, axis=-1), 1.0)
    return jnp.sum(per_seq_B) / jnp.maximum(num_seqs, 1.0)


@AGGREGATIONS.register("seq_mean_token_sum_norm")
def seq_mean_token_sum_norm(
    loss_BT: Array, mask_BT: Array, *, num_tokens, num_seqs, norm_len
) -> Array:
    """L = 1/(N * L_norm) sum_{i,t} m_it l_it  -- a constant normaliser, no length bias.

    Liu et al. 2025, "Understanding R1-Zero-Like Training" (Dr. GRPO); L_norm = `norm_len`, the
    generation budget (max completion tokens)."""
    del num_tokens
    return masked_sum(loss_BT, mask_BT) / (jnp.maximum(num_seqs, 1.0) * norm_len)


# ----------------------------------------------------------------------------- KL estimators
# Signature: fn(logp_BT, ref_logp_BT) -> per-token estimate of KL(pi || pi_ref), with
# log_r = log pi_ref - log pi and samples y ~ pi. Schulman 2020, "Approximating KL Divergence".


@KL_ESTIMATORS.register("k1")
def k1(logp_BT: Array, ref_logp_BT: Array) -> Array:
    """k1 = -log r = log pi - log pi_ref (unbiased, high variance, may be < 0). Schulman 2020."""
    return logp_BT - ref_logp_BT


@KL_ESTIMATORS.register("k2")
def k2(logp_BT: Array, ref_logp_BT: Array) -> Array:
    """k2 = 1/2 (log r)^2 (biased, low variance, >= 0). Schulman 2020."""
    return 0.5 * jnp.square(ref_logp_BT - logp_BT)


@KL_ESTIMATORS.register("k3")
def k3(logp_BT: Array, ref_logp_BT: Array) -> Array:
    """k3 = r - 1 - log r (unbiased, low variance, >= 0). Schulman 2020; GRPO (Shao et al. 2024)."""
    log_r = jnp.clip(ref_logp_BT - logp_BT, -_MAX_LOG_RATIO, _MAX_LOG_RATIO)
    return jnp.exp(log_r) - 1.0 - log_r


# ----------------------------------------------------------------------------- corrections
# Signature: fn(old_logp_BT, behav_logp_BT, mask_BT, *, cap, m2_tau) -> (weight_BT, mask_BT, stats)
# The weight multiplies the per-token policy loss (it carries no gradient); the returned mask
# replaces the loss mask. old_logp is the proximal policy (trainer's logprobs at the parameters
# that start the update), behav_logp the generator's mu. With old == behav every weight is 1 and
# no token is masked, so the corrected loss equals the uncorrected one.


def _is_stats(w_BT: Array, mask_BT: Array, new_mask_BT: Array) -> Stats:
    return {
        "is_weight_mean": masked_mean(w_BT, new_mask_BT),
        "is_weight_max": masked_max(w_BT, new_mask_BT),
        "masked_token_frac": masked_mean(
            ((mask_BT > 0) & (new_mask_BT <= 0)).astype(jnp.float32), mask_BT
        ),
    }


@CORRECTIONS.register("none", needs=(), scope="none")
def no_correction(old_logp_BT, behav_logp_BT, mask_BT, *, cap, m2_tau):
    """w = 1: trust that behaviour == proximal policy (on-policy, identical numerics)."""
    del behav_logp_BT, cap, m2_tau
    w_BT = jnp.ones_like(old_logp_BT)
    return w_BT, mask_BT, _is_stats(w_BT, mask_BT, mask_BT)


@CORRECTIONS.register("tis_token", needs=("behaviour",), scope="micro_batch")
def tis_token(old_logp_BT, behav_logp_BT, mask_BT, *, cap, m2_tau):
    """Truncated IS, token level:  w_t = min(pi_old(y_t) / mu(y_t), C).

    Yao et al. 2025, "Your Efficient RL Framework Secretly Brings You Off-Policy RL Training" (TIS);
    truncation from Espeholt et al. 2018 (IMPALA / V-trace)."""
    del m2_tau
    w_BT = jnp.minimum(_exp_ratio(old_logp_BT - behav_logp_BT), cap)
    return w_BT, mask_BT, _is_stats(w_BT, mask_BT, mask_BT)


@CORRECTIONS.register("tis_seq", needs=("behaviour",), scope="micro_batch")
def tis_seq(old_logp_BT, behav_logp_BT, mask_BT, *, cap, m2_tau):
    """Truncated IS, sequence level:  w_i = min(prod_t pi_old(y_it) / mu(y_it), C), on every token
    of sequence i. Computed in log space. Yao et al. 2025 (TIS, sequence variant); Espeholt et
    al. 2018 (IMPALA)."""
    del m2_tau
    m_BT = (mask_BT > 0).astype(old_logp_BT.dtype)
    log_w_B = jnp.sum((old_logp_BT - behav_logp_BT) * m_BT, axis=-1)
    w_B = jnp.exp(jnp.minimum(log_w_B, jnp.log(cap)))
    w_BT = jnp.broadcast_to(w_B[:, None], old_logp_BT.shape)
    return w_BT, mask_BT, _is_stats(w_BT, mask_BT, mask_BT)


@CORRECTIONS.register("decoupled", needs=("behaviour", "proximal"), scope="micro_batch")
def decoupled(old_logp_BT, behav_logp_BT, mask_BT, *, cap, m2_tau):
    """Decoupled PPO: the PPO ratio is taken against the proximal policy pi_prox (recomputed by the
    trainer; the step refuses to run without it) and the loss is weighted by the truncated
    behaviour weight  w_t = min(pi_prox(y_t) / mu(y_t), C):

        L_t = w_t * max(-A r_t, -A clip(r_t, 1 - eps_low, 1 + eps_high)),  r_t = pi / pi_prox.

    Hilton et al. 2022, "Batch size-invariance for policy optimization"; Fu et al. 2025, "AReaL".
    """
    return tis_token(old_logp_BT, behav_logp_BT, mask_BT, cap=cap, m2_tau=m2_tau)


@CORRECTIONS.register("m2po", needs=("behaviour", "proximal"), scope="batch")
def m2po(old_logp_BT, behav_logp_BT, mask_BT, *, cap, m2_tau):
    """Second-moment trust region (M2PO): drop the tokens with the largest M2_t = (log r_t)^2,
    log r_t = log pi_old(y_t) - log mu(y_t), until the batch mean of M2 over the kept tokens is
    <= tau. Kept tokens have weight 1. Zheng et al. 2025, "Prosperity before Collapse: How Far Can
    Off-Policy RL Reach with Stale Data on LLMs?" The paper drops the epsilon clip: pair this with
    a wide ppo_clip range. The mask is batch-global (the step computes it once per batch).
    """
    del cap
    valid_N = (mask_BT > 0).reshape(-1)
    m2_N = jnp.square(old_logp_BT - behav_logp_BT).reshape(-1)
    key_N = jnp.where(valid_N, m2_N, jnp.inf)  # masked tokens sort last
    order_N = jnp.argsort(key_N, stable=True)
    sorted_N = jnp.where(valid_N[order_N], m2_N[order_N], 0.0)
    count_N = jnp.arange(1, m2_N.shape[0] + 1, dtype=m2_N.dtype)
    prefix_mean_N = jnp.cumsum(sorted_N) / count_N  # mean of the k smallest, nondecreasing
    n_valid = jnp.sum(valid_N)
    ok_N = (prefix_mean_N <= m2_tau) & (jnp.arange(m2_N.shape[0]) < n_valid)
    n_keep = jnp.sum(ok_N)
    rank_N = jnp.zeros_like(order_N).at[order_N].set(jnp.arange(m2_N.shape[0]))
    keep_BT = ((rank_N < n_keep) & valid_N).reshape(mask_BT.shape)
    new_mask_BT = jnp.where(keep_BT, mask_BT, jnp.zeros_like(mask_BT))
    w_BT = jnp.ones_like(old_logp_BT)
    stats = _is_stats(jnp.exp(old_logp_BT - behav_logp_BT), mask_BT, new_mask_BT)
    stats["m2"] = masked_mean(m2_N.reshape(mask_BT.shape), mask_BT)
    return w_BT, new_mask_BT, stats


def log_ratio_m2(logp_BT: Array, behav_logp_BT: Array, mask_BT: Array) -> Array:
    """Second moment of the log importance ratio over the loss tokens,

        M2 = sum_t m_t (log pi(y_t) - log mu(y_t))^2 / sum_t m_t,

    the mismatch between the policy `pi` and the behaviour policy `mu` that sampled the tokens.
    Zheng et al. 2025 (M2PO) bound it by tau; `pipeline.lead=auto` sets the generator's lead
    from it (jaxrl.rl.lead)."""
    return masked_mean(jnp.square(logp_BT - behav_logp_BT), mask_BT)


def entropy_from_logits(logits_BTV: Array) -> Array:
    """H_t = logsumexp(z) - sum_v softmax(z)_v z_v, in f32."""
    z = logits_BTV.astype(jnp.float32)
    lse = jax.nn.logsumexp(z, axis=-1)
    return lse - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
