"""The training objective: composes the registered pieces of `algorithms` as `TrainConfig` says.

    adv_B              = advantage(rewards_B + overlong_penalty(|y|), groups)
    (w_BT, mask_BT)    = correction(pi_old, mu, loss_mask)            (w = 1 without correction)
    l_BT               = s_B * (sg(w_BT) * policy_loss(logp, pi_old, adv, mask)
                                + kl_coef * KL_k(pi, pi_ref) - entropy_coef * H(pi))
                         (s_B = batch.sample_weights: stale rows kept with a down-weight; else 1)
    loss               = aggregation(l_BT, mask_BT)    (normalised by WHOLE-batch counts)

Batch-global quantities (advantages, the M2PO mask, the normalisers) come from `prepare_targets`
on the full batch; `policy_objective` then runs per micro-batch, so summing its loss over
micro-batches gives the full-batch loss.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.train import algorithms as A
from jaxrl.train.batch import Batch
from jaxrl.train.config import TrainConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class Targets:
    """Per-batch quantities computed once on the full batch (all traced arrays)."""

    adv_B: jax.Array
    mask_BT: jax.Array  # loss mask after batch-global masking (M2PO)
    num_tokens: jax.Array
    num_seqs: jax.Array
    w_BT: jax.Array | None = None  # importance weights of a batch-scope correction


def correction_needs(cfg: TrainConfig) -> tuple[str, ...]:
    """What the configured correction needs in the batch ("behaviour", "proximal")."""
    return A.CORRECTIONS.meta(cfg.correction)["needs"]


def check_batch_for(cfg: TrainConfig, batch: Batch) -> None:
    """Fail early (host side, at trace time) when the batch lacks what the config needs."""
    needs = correction_needs(cfg)
    if "behaviour" in needs and batch.behaviour_logprobs is None:
        raise ValueError(
            f"train.correction={cfg.correction!r} needs the generator's behaviour logprobs, but "
            "batch.behaviour_logprobs is None; have the generator return them or set "
            "train.correction='none'"
        )
    if "proximal" in needs and batch.proximal_logprobs is None:
        raise ValueError(
            f"train.correction={cfg.correction!r} needs batch.proximal_logprobs (pi_old recomputed "
            "by the trainer); call Trainer.prepare(batch) first"
        )
    if cfg.kl_coef > 0 and batch.ref_logprobs is None:
        raise ValueError(
            f"train.kl_coef={cfg.kl_coef} needs batch.ref_logprobs; call Trainer.prepare(batch) "
            "with a reference model, or set train.kl_coef=0"
        )


def prepare_targets(cfg: TrainConfig, batch: Batch) -> tuple[Targets, dict]:
    valid_B = jnp.any(batch.segment_ids > 0, axis=-1).astype(jnp.float32)
    rewards_B = batch.rewards
    stats = {}
    if cfg.overlong_max_len:
        lengths_B = jnp.sum(batch.loss_mask, axis=-1)
        pen_B = A.overlong_penalty(
            lengths_B, max_len=cfg.overlong_max_len, cache_len=cfg.overlong_cache_len
        )
        rewards_B = rewards_B + pen_B
        stats["reward/overlong_penalty_mean"] = A.masked_mean(pen_B, valid_B)
    adv_fn = A.ADVANTAGES.get(cfg.advantage)
    adv_B = adv_fn(rewards_B, batch.group_ids, valid_B, eps=cfg.adv_eps)
    mask_BT = batch.loss_mask
    if A.CORRECTIONS.meta(cfg.correction)["scope"] == "batch":  # e.g. M2PO's global mask
        w_BT, mask_BT, cstats = A.CORRECTIONS.get(cfg.correction)(
            batch.proximal_logprobs,
            batch.behaviour_logprobs,
            mask_BT,
            cap=cfg.is_cap,
            m2_tau=cfg.m2_tau,
        )
        stats.update({f"is/{k.removeprefix('is_')}": v for k, v in cstats.items()})
    else:
        w_BT = None
    num_tokens, num_seqs = A.batch_counts(mask_BT)
    stats["train/loss_tokens"] = num_tokens
    stats["train/advantage_abs_mean"] = A.masked_mean(jnp.abs(adv_B), valid_B)
    targets = Targets(adv_B=adv_B, mask_BT=mask_BT, num_tokens=num_tokens, num_seqs=num_seqs,
                      w_BT=w_BT)
    return targets, stats


def policy_objective(
    cfg: TrainConfig, logp_BT, entropy_BT, batch: Batch, targets: Targets
) -> tuple[jax.Array, dict]:
    """Scalar loss of one (micro-)batch and its statistics (masked means over its loss tokens).

    `batch` and `targets` are the micro-batch slices; `logp_BT` carries the gradient."""
    mask_BT = targets.mask_BT
    if batch.proximal_logprobs is not None:
        old_BT = batch.proximal_logprobs
    else:  # one update per batch: pi_old is the current policy (ratio 1, gradient flows)
        old_BT = jax.lax.stop_gradient(logp_BT)
    stats = {}
    w_BT = targets.w_BT
    if A.CORRECTIONS.meta(cfg.correction)["scope"] == "micro_batch":
        corr = A.CORRECTIONS.get(cfg.correction)
        w_BT, mask_BT, cstats = corr(
            jax.lax.stop_gradient(old_BT),
            batch.behaviour_logprobs,
            mask_BT,
            cap=cfg.is_cap,
            m2_tau=cfg.m2_tau,
        )
        stats.update({f"is/{k.removeprefix('is_')}": v for k, v in cstats.items()})
    if batch.behaviour_logprobs is not None:  # drift of pi from mu (adaptive staleness)
        stats["is/behaviour_m2"] = A.log_ratio_m2(
            jax.lax.stop_gradient(logp_BT), batch.behaviour_logprobs, batch.loss_mask)
    loss_fn = A.POLICY_LOSSES.get(cfg.policy_loss)
    pg_BT, pstats = loss_fn(
        logp_BT,
        old_BT,
        targets.adv_B,
        mask_BT,
        eps_low=cfg.eps_low,
        eps_high=cfg.eps_high,
        dual_clip=cfg.dual_clip,
    )
    stats.update({f"policy/{k}": v for k, v in pstats.items()})
    if w_BT is not None:
        pg_BT = pg_BT * jax.lax.stop_gradient(w_BT)
    row_w_B1 = 1.0 if batch.sample_weights is None else batch.sample_weights[:, None]
    pg_BT = pg_BT * row_w_B1
    agg = A.AGGREGATIONS.get(cfg.loss_aggregation)
    norm_len = cfg.norm_len or logp_BT.shape[1]
    counts = dict(num_tokens=targets.num_tokens, num_seqs=targets.num_seqs, norm_len=norm_len)
    pg_loss = agg(pg_BT, mask_BT, **counts)
    loss = pg_loss
    stats["loss/policy"] = pg_loss
    if batch.ref_logprobs is not None:  # KL to the frozen reference policy
        kl_BT = A.KL_ESTIMATORS.get(cfg.kl_estimator)(logp_BT, batch.ref_logprobs)
        stats["policy/ref_kl"] = A.masked_mean(jax.lax.stop_gradient(kl_BT), mask_BT)
        if cfg.kl_coef > 0:
            kl_loss = agg(kl_BT * row_w_B1, mask_BT, **counts)
            loss = loss + cfg.kl_coef * kl_loss
            stats["loss/kl"] = kl_loss
    if cfg.entropy_coef > 0:  # entropy bonus, aggregated like the policy loss
        ent_loss = agg(entropy_BT * row_w_B1, mask_BT, **counts)
        loss = loss - cfg.entropy_coef * ent_loss
        stats["loss/entropy_bonus"] = -cfg.entropy_coef * ent_loss
    stats["loss/total"] = loss
    stats["policy/entropy"] = A.masked_mean(jax.lax.stop_gradient(entropy_BT), mask_BT)
    return loss, stats


def prepare_sft_targets(cfg: TrainConfig, batch: Batch) -> tuple[Targets, dict]:
    """Supervised fine-tuning: the loss covers `batch.loss_mask` (the demonstration tokens)."""
    num_tokens, num_seqs = A.batch_counts(batch.loss_mask)
    adv_B = jnp.zeros(batch.rewards.shape, jnp.float32)
    return Targets(adv_B=adv_B, mask_BT=batch.loss_mask, num_tokens=num_tokens,
                   num_seqs=num_seqs), {}


def sft_objective(cfg: TrainConfig, logp_BT, entropy_BT, batch: Batch, targets: Targets):
    """Mean negative log-likelihood of the loss tokens, normalised by the WHOLE batch's token
    count (so micro-batch losses sum to the full-batch loss):

        loss = -sum_{b,t} mask_bt * log pi(y_bt | y_<bt) / max(sum mask, 1)
    """
    loss = -jnp.sum(logp_BT * targets.mask_BT) / jnp.maximum(targets.num_tokens, 1.0)
    return loss, {"loss/total": loss}


# name -> (batch-global targets, per-micro-batch loss); `make_train_step(objective=...)`
OBJECTIVES = {
    "policy": (prepare_targets, policy_objective),
    "sft": (prepare_sft_targets, sft_objective),
}


# Statistics that are summed over micro-batches (the losses, already globally normalised);
# keys ending in "_max" take the max; every other key is a token-weighted mean.
SUMMED_STATS = ("loss/policy", "loss/kl", "loss/entropy_bonus", "loss/total")


def combine_stats(acc: dict, new: dict, frac) -> dict:
    """Fold one micro-batch's stats into the running ones; `frac` = its share of loss tokens."""
    out = {}
    for k, v in new.items():
        if k in SUMMED_STATS:
            out[k] = acc[k] + v
        elif k.endswith("_max"):
            out[k] = jnp.maximum(acc[k], v)
        else:
            out[k] = acc[k] + frac * v
    return out
