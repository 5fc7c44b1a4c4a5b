"""Trainer configuration: one frozen dataclass, validated on construction (no jax import here).

The name tuples below are the registries of `jaxrl.train.algorithms` (a test keeps them equal).
"""

from __future__ import annotations

import dataclasses

from jaxrl.config.base import ConfigError
from jaxrl.dtypes import canonical_dtype

ADVANTAGE_NAMES = ("drgrpo", "grpo", "rloo")
POLICY_LOSS_NAMES = ("cispo", "gspo", "ppo_clip")
AGGREGATION_NAMES = ("seq_mean_token_mean", "seq_mean_token_sum_norm", "token_mean")
KL_ESTIMATOR_NAMES = ("k1", "k2", "k3")
CORRECTION_NAMES = ("decoupled", "m2po", "none", "tis_seq", "tis_token")
SCHEDULE_NAMES = ("constant", "cosine")
REMAT_NAMES = ("none", "full", "dots", "dots_no_batch")
NAN_POLICIES = ("stop", "skip")
# What each correction needs in the batch, and where it runs, is registered with it
# (`jaxrl.train.algorithms.CORRECTIONS.meta(name)`).


def _choice(field: str, value: str, choices: tuple[str, ...]) -> None:
    if value not in choices:
        raise ConfigError(f"train.{field}={value!r} is not valid; choose one of {list(choices)}")


def _check(field: str, ok: bool, value: object, need: str) -> None:
    if not ok:
        raise ConfigError(f"train.{field}={value!r} is not valid; it must be {need}")


@dataclasses.dataclass(frozen=True)
class TrainConfig:
    """Everything the trainer needs to turn a batch into an update.

    Algorithm choice: `advantage` x `policy_loss` x `aggregation` (+ `kl_*`, `correction`,
    `overlong_*`). Defaults are DAPO-flavoured GRPO: grpo advantages, ppo_clip with clip-higher
    (0.2 / 0.28), token_mean aggregation, no KL, no off-policy correction.
    """

    # --- algorithm
    advantage: str = "grpo"
    adv_eps: float = 1e-6
    policy_loss: str = "ppo_clip"
    eps_low: float = 0.2
    eps_high: float = 0.28
    dual_clip: float = 0.0  # 0 = off; else c > 1 (caps the loss at c*|A| for A < 0)
    # "auto": seq_mean_token_mean for gspo (its published, sequence-level objective), token_mean
    # otherwise; `loss_aggregation` is the resolved name
    aggregation: str = "auto"
    norm_len: int = 0  # L_norm for seq_mean_token_sum_norm (0 = the batch's padded length T)
    kl_coef: float = 0.0  # 0 = no KL term (the reference policy is built only when needed)
    kl_estimator: str = "k3"
    # the frozen reference policy: the run's initial policy, or this local HF directory; stored
    # in `ref_dtype` (None: the trainer's param dtype; "bfloat16" halves its memory)
    ref_init: str | None = None
    ref_dtype: str | None = None
    ref_metrics: bool = False  # also report policy/ref_kl when kl_coef is 0 (one more forward)
    entropy_coef: float = 0.0  # entropy bonus: loss -= entropy_coef * aggregation(entropy)
    # a mixture of experts: the policy (and pi_old) forwards use the experts the generator
    # chose (`Batch.routed_experts`) instead of the router's top-k; the router still weights
    # them and gets gradients (R3, Ma et al. 2025, arXiv:2510.11370). No effect on a dense model
    routing_replay: bool = False
    correction: str = "none"
    is_cap: float = 2.0  # C of truncated IS / decoupled PPO
    m2_tau: float = 0.04  # tau of M2PO
    overlong_max_len: int = 0  # L_max in tokens; 0 = no overlong penalty
    overlong_cache_len: int = 0  # L_cache in tokens
    # --- optimiser
    lr: float = 1e-6
    min_lr_ratio: float = 0.0  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 0
    schedule: str = "constant"
    total_steps: int = 1000  # cosine horizon
    b1: float = 0.9
    b2: float = 0.999
    adam_eps: float = 1e-8
    weight_decay: float = 0.01
    max_grad_norm: float = 1.0  # 0 = no clipping
    # --- updates per rollout batch: `epochs` passes, each cut into `mini_batches` updates (groups
    # kept whole; every ratio against the policy that generated the batch). 1 and 1: one update.
    mini_batches: int = 1
    epochs: int = 1
    # --- precision: master weights + optimizer state (param_dtype) and the forward / backward
    # (compute_dtype). "auto": the model config's param dtype; compute bf16 on accelerators
    # (with f32 master weights: mixed precision), the model config's dtype on CPU.
    param_dtype: str = "auto"
    compute_dtype: str = "auto"
    # --- step mechanics
    micro_batches: int = 1  # gradient accumulation inside one update
    # Each group's shared prompt runs once per step, not once per sample (`jaxrl.train.prefix`;
    # dense models; with mini-batches, each laid out on its own); False: every row's full forward.
    share_prompts: bool = True
    remat: str = "none"
    logprob_chunk: int = 128  # tokens per chunk of the lm-head/log-softmax pass
    # The train step's backward reuses the forward's softmax instead of recomputing the lm head
    # when one micro-batch's [B, T, V] f32 softmax is at most this many MiB (0 = always recompute).
    lm_head_keep_mb: int = 1024
    nan_policy: str = "stop"
    # --- checkpoints
    checkpoint_every: int = 0  # 0 = never
    checkpoint_keep: int = 3
    seed: int = 0

    def __post_init__(self) -> None:
        _choice("advantage", self.advantage, ADVANTAGE_NAMES)
        _choice("policy_loss", self.policy_loss, POLICY_LOSS_NAMES)
        _choice("aggregation", self.aggregation, ("auto", *AGGREGATION_NAMES))
        if self.policy_loss == "gspo" and self.aggregation not in ("auto", "seq_mean_token_mean"):
            raise ConfigError(
                f"train.policy_loss='gspo' with train.aggregation={self.aggregation!r} is not the "
                "published GSPO objective (a token-level mean weights long sequences more and "
                "changes what the sequence-level ratio optimises); use aggregation "
                "'seq_mean_token_mean' (or 'auto')")
        for name in ("param_dtype", "compute_dtype", "ref_dtype"):
            value = getattr(self, name)
            if value not in (None, "auto"):  # jnp.bfloat16, np.float32, "bfloat16", ...
                object.__setattr__(self, name,
                                   canonical_dtype(value, f"train.{name}", ConfigError))
        _choice("kl_estimator", self.kl_estimator, KL_ESTIMATOR_NAMES)
        _choice("correction", self.correction, CORRECTION_NAMES)
        _choice("schedule", self.schedule, SCHEDULE_NAMES)
        _choice("remat", self.remat, REMAT_NAMES)
        _choice("nan_policy", self.nan_policy, NAN_POLICIES)
        _check("adv_eps", self.adv_eps >= 0, self.adv_eps, ">= 0")
        _check("eps_low", 0 <= self.eps_low, self.eps_low, ">= 0")
        _check("eps_high", 0 <= self.eps_high, self.eps_high, ">= 0")
        _check("dual_clip", self.dual_clip == 0 or self.dual_clip > 1, self.dual_clip, "0 or > 1")
        if self.dual_clip and self.policy_loss != "ppo_clip":
            raise ConfigError(
                f"train.dual_clip={self.dual_clip} only applies to policy_loss='ppo_clip'; "
                f"got policy_loss={self.policy_loss!r}"
            )
        _check("norm_len", self.norm_len >= 0, self.norm_len, ">= 0")
        _check("kl_coef", self.kl_coef >= 0, self.kl_coef, ">= 0")
        _check("entropy_coef", self.entropy_coef >= 0, self.entropy_coef, ">= 0")
        _check("is_cap", self.is_cap >= 1, self.is_cap, ">= 1")
        _check("m2_tau", self.m2_tau > 0, self.m2_tau, "> 0")
        if self.overlong_max_len:
            ok = 0 < self.overlong_cache_len <= self.overlong_max_len
            _check("overlong_cache_len", ok, self.overlong_cache_len, "in (0, overlong_max_len]")
        _check("lr", self.lr >= 0, self.lr, ">= 0")
        _check("min_lr_ratio", 0 <= self.min_lr_ratio <= 1, self.min_lr_ratio, "in [0, 1]")
        _check("warmup_steps", self.warmup_steps >= 0, self.warmup_steps, ">= 0")
        _check("total_steps", self.total_steps >= 1, self.total_steps, ">= 1")
        _check("max_grad_norm", self.max_grad_norm >= 0, self.max_grad_norm, ">= 0")
        _check("micro_batches", self.micro_batches >= 1, self.micro_batches, ">= 1")
        _check("mini_batches", self.mini_batches >= 1, self.mini_batches, ">= 1")
        _check("epochs", self.epochs >= 1, self.epochs, ">= 1")
        _check("logprob_chunk", self.logprob_chunk >= 1, self.logprob_chunk, ">= 1")
        _check("lm_head_keep_mb", self.lm_head_keep_mb >= 0, self.lm_head_keep_mb, ">= 0")
        _check("checkpoint_every", self.checkpoint_every >= 0, self.checkpoint_every, ">= 0")
        _check("checkpoint_keep", self.checkpoint_keep >= 1, self.checkpoint_keep, ">= 1")

    @property
    def loss_aggregation(self) -> str:
        """The aggregation the loss uses ("auto" resolved by the policy loss)."""
        if self.aggregation != "auto":
            return self.aggregation
        return "seq_mean_token_mean" if self.policy_loss == "gspo" else "token_mean"

    @property
    def needs_reference(self) -> bool:
        return self.kl_coef > 0 or self.ref_metrics

    def precision(self, model_param_dtype: str, model_dtype: str, platform: str) -> tuple[str, str]:
        """(param dtype, compute dtype) of the trainer's model on `platform` ("cpu", "gpu",
        "tpu"), "auto" resolved as the fields say."""
        param = model_param_dtype if self.param_dtype == "auto" else self.param_dtype
        if self.compute_dtype != "auto":
            return param, self.compute_dtype
        return param, model_dtype if platform == "cpu" else "bfloat16"
