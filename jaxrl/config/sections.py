"""Config sections of the model, the meshes, the generator, rewards, the pipeline and processes.

Frozen dataclasses; an invalid value fails in `__post_init__` naming the key, the value and what
is allowed. No JAX imports.
"""

from __future__ import annotations

import dataclasses
import math
import typing
from typing import Literal

from jaxrl.config.base import (
    ConfigError,
    DTypeName,
    check_choice,
    check_positive,
    validate_literals,
)
from jaxrl.dtypes import canonical_dtype
from jaxrl.rounding import kv_cache_len

AttentionImpl = Literal["xla", "pallas", "cudnn", "auto"]
Architecture = Literal["gemma2", "gemma3", "llama", "mistral", "mixtral", "olmo2", "olmo3",
                       "phi3", "qwen2", "qwen3", "qwen3_moe"]
MOE_ARCHITECTURES = ("mixtral", "qwen3_moe")
# Gemma 2 / 3: (1 + w) RMSNorm, embeddings scaled by sqrt(hidden), sandwich norms, GeGLU
GEMMA_ARCHITECTURES = ("gemma2", "gemma3")
LAYER_TYPES = ("full_attention", "sliding_attention")  # HF's names in layer_types
KVLayout = Literal["contiguous", "paged"]
# the generator's copy of the weights: as synced, weight-only int8, or int8 weights and per-token
# int8 activations (jaxrl.models.quant)
Quantize = Literal["none", "int8", "w8a8", "fp8"]
RopeType = Literal["llama3", "linear"]  # HF rope_scaling.rope_type
LoraTarget = Literal["q", "k", "v", "o", "gate", "up", "down"]
LoraGenerator = Literal["merge", "forward"]
LORA_TARGETS: tuple[str, ...] = typing.get_args(LoraTarget)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """RoPE frequency scaling of the full-attention layers (HF's `rope_scaling`). `rope_type`
    "llama3": Llama 3.1's (long wavelengths divided by `factor`, short ones kept, the band
    between interpolated; the other fields are its parameters); "linear": every inverse
    frequency divided by `factor` (positions by `factor`: Gemma 3 4B+). Gemma 3 and OLMo 3
    scale their full-attention layers only; their sliding layers keep their plain base."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192
    rope_type: RopeType = "llama3"

    def __post_init__(self):
        validate_literals(self)
        if not math.isfinite(self.factor) or self.factor <= 0:
            raise ConfigError(f"model.rope_scaling.factor must be a finite number > 0, got "
                              f"{self.factor}")


@dataclasses.dataclass(frozen=True)
class LoraConfig:
    """Low-rank adapters on the named projections (`rank=0`: off, every weight trains).

    Close to PEFT's `LoraConfig`: `rank` is `r`, `alpha` is `lora_alpha`, `targets` are the
    `target_modules` (q/k/v/o_proj of attention, gate/up/down_proj of the MLP); the update is
    scaled by `alpha / rank` (`alpha / sqrt(rank)` with `rslora`). Adapters and their optimiser
    state are float32 whatever the base's dtype. `generator`: how the generator applies them --
    "merge" folds `W + s A B` into its own copy of the base after each sync (decode runs the
    plain model), "forward" adds `s (x A) B` in every forward pass (no second copy of the
    targeted weights). Dropout is not offered: it would make the trainer's logprobs differ from
    the generator's behaviour logprobs.
    """

    rank: int = 0
    alpha: float = 16.0
    targets: tuple[LoraTarget, ...] = LORA_TARGETS
    rslora: bool = False
    generator: LoraGenerator = "merge"

    def __post_init__(self):
        object.__setattr__(self, "targets", tuple(self.targets))
        validate_literals(self)
        if self.rank < 0:
            raise ConfigError(f"model.lora.rank must be >= 0 (0 turns LoRA off), got {self.rank}")
        if not math.isfinite(self.alpha) or self.alpha <= 0:
            raise ConfigError(f"model.lora.alpha must be a finite number > 0, got {self.alpha}")
        bad = [t for t in self.targets if t not in LORA_TARGETS]
        if bad or not self.targets or len(set(self.targets)) != len(self.targets):
            raise ConfigError(
                f"model.lora.targets must be distinct names from {list(LORA_TARGETS)}, got "
                f"{list(self.targets)}")

    @property
    def enabled(self) -> bool:
        return self.rank > 0

    @property
    def scale(self) -> float:
        return self.alpha / (math.sqrt(self.rank) if self.rslora else self.rank)


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of the Llama / Mistral / OLMo 2 / Phi-3 / Qwen2 / Qwen3 family,
    or a mixture of experts (Qwen3-MoE, Mixtral).

    Mixture of experts (`architecture="qwen3_moe"` or `"mixtral"`, `num_experts > 0`; HF's
    `Qwen3MoeConfig`, and `MixtralConfig`, which is `norm_topk_prob=True` with every layer sparse):
    layer i is sparse when `i not in mlp_only_layers and (i + 1) % decoder_sparse_step == 0`,
    else a dense MLP of `intermediate_size`. A sparse layer routes each token to the
    `experts_per_token` experts of highest softmax probability (renormalised over those when
    `norm_topk_prob`), each a SwiGLU MLP of `moe_intermediate_size`. `router_aux_loss_coef`: the
    weight of the Switch-Transformer load-balancing loss; only 0 (off, as RL wants) for now.
    """

    architecture: Architecture = "qwen2"
    vocab_size: int = 128
    hidden_size: int = 64
    intermediate_size: int = 128
    num_layers: int = 2
    num_heads: int = 4
    num_kv_heads: int = 2
    head_dim: int | None = None  # None: hidden_size // num_heads
    rope_theta: float = 10000.0
    rope_scaling: RopeScaling | None = None
    rms_norm_eps: float = 1e-6
    max_position_embeddings: int = 2048
    tie_embeddings: bool = True
    qkv_bias: bool = False  # Qwen2 (and Llama with attention_bias)
    o_bias: bool = False  # Llama with attention_bias
    qk_norm: bool = False  # Qwen3: RMSNorm over head_dim on q and k
    qk_norm_full: bool = False  # OLMo 2: that RMSNorm over all heads of q (of k) together
    post_norm: bool = False  # OLMo 2: each sublayer's output normed before the residual add
    dtype: DTypeName = "float32"  # compute dtype
    param_dtype: DTypeName = "float32"  # storage dtype
    attention_impl: AttentionImpl = "auto"
    remat: bool = False  # rematerialise each decoder layer in the backward pass
    lora: LoraConfig = LoraConfig()  # low-rank adapters (rank 0: off)
    num_experts: int = 0  # > 0: mixture of experts (architecture qwen3_moe or mixtral)
    experts_per_token: int = 2  # top-k
    moe_intermediate_size: int | None = None  # None: intermediate_size
    norm_topk_prob: bool = False
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    router_aux_loss_coef: float = 0.0
    # sliding-window attention (HF's definition: a query at position p sees keys in
    # (p - sliding_window, p]) in the layers layer_types names "sliding_attention"; empty
    # layer_types with a window: every layer slides (Mistral)
    sliding_window: int | None = None
    layer_types: tuple[str, ...] = ()
    attn_logit_softcap: float | None = None  # Gemma 2: scores = cap * tanh(scores / cap)
    final_logit_softcap: float | None = None  # Gemma 2: logits = cap * tanh(logits / cap)
    query_pre_attn_scalar: float | None = None  # Gemma: scores scaled by its -1/2 (None: head)
    rope_local_theta: float | None = None  # Gemma 3: sliding layers' rope base (None: same)

    def __post_init__(self):
        object.__setattr__(self, "mlp_only_layers", tuple(self.mlp_only_layers))
        object.__setattr__(self, "layer_types", tuple(self.layer_types))
        for name in ("dtype", "param_dtype"):  # jnp.bfloat16, np.float32, "bfloat16", ...
            object.__setattr__(self, name,
                               canonical_dtype(getattr(self, name), f"model.{name}", ConfigError))
        validate_literals(self)
        check_positive(
            "model",
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size,
            num_layers=self.num_layers,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_dim,
        )
        if self.num_heads % self.num_kv_heads:
            raise ConfigError(
                f"model.num_heads ({self.num_heads}) must be a multiple of "
                f"model.num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is None and self.hidden_size % self.num_heads:
            raise ConfigError(
                f"model.hidden_size ({self.hidden_size}) is not divisible by model.num_heads "
                f"({self.num_heads}); set model.head_dim explicitly"
            )
        if self.qk_norm_full and not self.qk_norm:
            raise ConfigError("model.qk_norm_full=True normalises q and k over all heads, which "
                              "needs model.qk_norm=True")
        self._check_window()
        self._check_moe()

    def _check_window(self) -> None:
        check_positive("model", sliding_window=self.sliding_window,
                       attn_logit_softcap=self.attn_logit_softcap,
                       final_logit_softcap=self.final_logit_softcap,
                       query_pre_attn_scalar=self.query_pre_attn_scalar,
                       rope_local_theta=self.rope_local_theta)
        bad = [t for t in self.layer_types if t not in LAYER_TYPES]
        if bad or len(self.layer_types) not in (0, self.num_layers):
            raise ConfigError(
                f"model.layer_types must be empty or one of {list(LAYER_TYPES)} per layer "
                f"({self.num_layers}), got {list(self.layer_types)}")
        if "sliding_attention" in self.layer_types and self.sliding_window is None:
            raise ConfigError("model.layer_types names sliding_attention layers but "
                              "model.sliding_window is None; set the window")

    def layer_window(self, i: int) -> int | None:
        """Layer `i`'s sliding window, or None for full causal attention."""
        if self.sliding_window is None:
            return None
        if self.layer_types and self.layer_types[i] != "sliding_attention":
            return None
        return self.sliding_window

    def _check_moe(self) -> None:
        moe = self.architecture in MOE_ARCHITECTURES
        if moe != (self.num_experts > 0):
            raise ConfigError(
                f"model.num_experts={self.num_experts} with model.architecture="
                f"{self.architecture!r}: a mixture of experts is architecture "
                f"{' or '.join(map(repr, MOE_ARCHITECTURES))} with num_experts > 0, every other "
                "architecture has num_experts 0")
        if not moe:
            return
        check_positive("model", experts_per_token=self.experts_per_token,
                       moe_intermediate_size=self.moe_intermediate_size,
                       decoder_sparse_step=self.decoder_sparse_step)
        if self.experts_per_token > self.num_experts:
            raise ConfigError(
                f"model.experts_per_token ({self.experts_per_token}) must be <= "
                f"model.num_experts ({self.num_experts})")
        bad = [i for i in self.mlp_only_layers if not 0 <= i < self.num_layers]
        if bad:
            raise ConfigError(f"model.mlp_only_layers: layer indices must lie in "
                              f"[0, {self.num_layers}), got {list(self.mlp_only_layers)}")
        if self.router_aux_loss_coef != 0:  # jaxrl.models.moe.load_balancing_loss is the term
            raise ConfigError(f"model.router_aux_loss_coef={self.router_aux_loss_coef}: the "
                              "load-balancing loss is not added to the training loss yet; "
                              "only 0 (off, the setting for RL) is accepted")
        mlp_targets = [t for t in self.lora.targets if t in ("gate", "up", "down")]
        if self.lora.enabled and mlp_targets:
            raise ConfigError(
                f"model.lora.targets {list(self.lora.targets)} include MLP projections "
                f"{mlp_targets}, which a mixture-of-experts model does not adapt (LoRA on expert "
                "weights is not supported); set model.lora.targets to attention projections, "
                "e.g. --model.lora.targets=q,k,v,o")

    def is_sparse_layer(self, i: int) -> bool:
        """Whether layer `i` is a mixture-of-experts layer (HF Qwen3-MoE's rule)."""
        return (self.num_experts > 0 and i not in self.mlp_only_layers
                and (i + 1) % self.decoder_sparse_step == 0)

    @property
    def expert_size(self) -> int:
        """The intermediate size of one expert."""
        if self.moe_intermediate_size is None:
            return self.intermediate_size
        return self.moe_intermediate_size

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def num_params(self, include_embeddings: bool = True, active: bool = False) -> int:
        """Parameter count (used for FLOP estimates); `active`: of a mixture of experts, only the
        router and the `experts_per_token` experts one token passes through."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_size
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        if self.o_bias:
            attn += e
        norms = 4 if self.architecture in GEMMA_ARCHITECTURES else 2  # sandwich norms
        total = self.num_layers * (attn + norms * e) + e
        experts = self.experts_per_token if active else self.num_experts
        for i in range(self.num_layers):
            if self.is_sparse_layer(i):
                total += e * self.num_experts + 3 * e * self.expert_size * experts
            else:
                total += 3 * e * f
        if include_embeddings:
            total += self.vocab_size * e * (1 if self.tie_embeddings else 2)
        return total


@dataclasses.dataclass(frozen=True)
class MeshConfig:
    """How devices are split between the trainer and the generator.

    `trainer` is (fsdp, tp) and `generator` is (dp, tp). `None` means automatic: half of the
    devices each (all of them for both roles when there is only one device, i.e. colocated).
    With `colocated=True` both roles use the same devices, time-shared.

    `cpu_cores` matters only on a CPU backend with separate roles. "shared" (default): both
    roles' simulated devices on XLA's one CPU thread pool, every core for whichever role runs.
    "split": disjoint host cores per role (the generator on a CPU client of its own), as two
    devices would be; the setting for measuring pipeline overlap on a CPU. See jaxrl/cpu.py.
    """

    trainer: tuple[int, ...] | None = None
    generator: tuple[int, ...] | None = None
    colocated: bool = False
    cpu_cores: Literal["shared", "split"] = "shared"
    # the memory plan printed before any work (jaxrl/train/memory/): "fail" stops a run
    # that does not fit, "warn" only says so (the activation figures are estimates);
    # memory_budget_gib overrides the device's memory (0: memory_stats, or host RAM on CPU)
    memory_check: Literal["fail", "warn", "off"] = "fail"
    memory_budget_gib: float = 0.0

    def __post_init__(self):
        for name in ("trainer", "generator"):
            shape = getattr(self, name)
            if shape is None:
                continue
            if len(shape) != 2 or any(int(s) < 1 for s in shape):
                axes = "(fsdp, tp)" if name == "trainer" else "(dp, tp)"
                raise ConfigError(
                    f"mesh.{name}: expected two positive sizes {axes}, e.g. 4x1; got {shape!r}"
                )
        validate_literals(self)
        if self.memory_budget_gib < 0:
            raise ConfigError(f"mesh.memory_budget_gib={self.memory_budget_gib} must be >= 0 "
                              "(0 = the device's memory)")


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """The generator engine and its sampling settings (group size and lengths live in `data`)."""

    num_slots: int = 64  # concurrent samples (decode batch) on the generator mesh
    # KV-cache length per slot. 0 = automatic: 1.5x the longest of 64 held-out prompts + 8, plus
    # data.max_new_tokens, rounded up to a multiple of 16 (and of page_size when paged; see
    # `kv_len`); a longer prompt is rejected, so set it explicitly for datasets with long prompts.
    max_len: int = 0
    chunk_steps: int = 16  # decode steps per host round trip
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    # rollouts: no EOS / stop id before this many new tokens (their logits are -inf there)
    min_tokens: int = 0
    ignore_eos: bool = False  # rollouts run on through EOS to data.max_new_tokens
    dtype: DTypeName | None = None  # cast weights to this dtype on sync (None: trainer's dtype)
    # KV cache: one [slots, max_len] row per slot, or pages of `page_size` positions read through
    # a page table (paged decode attention; see docs/generate.md)
    kv_layout: KVLayout = "contiguous"
    page_size: int = 16  # positions per page (kv_layout="paged"; the GPU kernel needs 2^k >= 16)
    # "int8": each publish quantizes the decoder layers' projections for the generator (per
    # output channel, weight-only; the trainer keeps its precision; behaviour logprobs come from
    # the int8 policy, so pair it with an off-policy correction such as train.correction);
    # "w8a8": the same weights, and each projection also quantizes its input per token and
    # contracts in int8 (faster than f32 on CPU, where weight-only int8 is slower); "fp8": w8a8
    # in float8 e4m3, contracting e4m3 x e4m3 with f32 sums (for accelerators with fp8
    # matmuls, e.g. Hopper GPUs; XLA:CPU converts to f32 and runs at about f32's speed)
    quantize: Quantize = "none"
    # each publish joins the generator's q/k/v and dense gate/up projections into one wider
    # matmul each (jaxrl/models/transformer.py, fuse_projections; docs/benchmarks.md, "Generator
    # decode"); not applied to LoRA runs (adapters target the unfused projections). The trainer,
    # checkpoints and HF export keep the unfused layout.
    fuse_projections: bool = False
    # for tests and benchmarks only: an artificially slow generator. Each decode chunk sleeps
    # this many seconds divided by the generator's device count (work its chips share evenly, so
    # it speeds up with chips as a compute-bound generator would; simulated CPU devices share the
    # host's cores, so their real compute does not). 0 = off.
    debug_chunk_delay_s: float = 0.0
    # prefill/decode disaggregation: this many of the generator's devices (whole dp rows, a
    # multiple of its tp) prefill with their own copy of the weights, the rest decode; each
    # prompt's KV cache moves between them (jaxrl/generate/disaggregated.py). 0 = colocated.
    prefill_devices: int = 0

    def kv_len(self, positions: int) -> int:
        """KV-cache positions per slot: `max_len`, or when it is 0 the run's sequence capacity
        `positions` rounded by `jaxrl.rounding.kv_cache_len` (the run and its memory plan)."""
        page = self.page_size if self.kv_layout == "paged" else 1
        return self.max_len or kv_cache_len(positions, page)

    def __post_init__(self):
        if self.dtype is not None:
            object.__setattr__(self, "dtype",
                               canonical_dtype(self.dtype, "generate.dtype", ConfigError))
        if self.prefill_devices < 0:
            raise ConfigError(f"generate.prefill_devices: must be >= 0 (0 = prefill and decode "
                              f"on the same devices), got {self.prefill_devices}")
        check_choice("generate", "kv_layout", self.kv_layout, typing.get_args(KVLayout))
        check_choice("generate", "quantize", self.quantize, typing.get_args(Quantize))
        validate_literals(self) if self.dtype is not None else None
        check_positive("generate", num_slots=self.num_slots, chunk_steps=self.chunk_steps,
                        page_size=self.page_size)
        if self.max_len < 0:
            raise ConfigError(f"generate.max_len: must be >= 0 (0 = automatic), got {self.max_len}")
        if self.min_tokens < 0:
            raise ConfigError(f"generate.min_tokens: must be >= 0, got {self.min_tokens}")
        if not (math.isfinite(self.debug_chunk_delay_s) and self.debug_chunk_delay_s >= 0):
            raise ConfigError(f"generate.debug_chunk_delay_s: must be a finite number >= 0 "
                              f"(0 = off), got {self.debug_chunk_delay_s}")
        if self.temperature < 0 or not 0 < self.top_p <= 1 or self.top_k < 0:
            raise ConfigError(
                f"generate: need temperature >= 0, 0 < top_p <= 1, top_k >= 0; got "
                f"temperature={self.temperature}, top_p={self.top_p}, top_k={self.top_k}"
            )


@dataclasses.dataclass(frozen=True)
class RewardsConfig:
    """Where rewards run: the local sandbox pool, or a Ray cluster of CPU hosts."""

    backend: Literal["local", "ray"] = "local"
    address: str | None = None  # Ray: "auto", "ray://host:10001", or None to start a local Ray
    num_workers: int = 0  # sandbox slots; 0 = one per CPU core
    tier: Literal["auto", "A", "B"] = "auto"  # isolation tier (see jaxrl.sandbox.zygote)
    timeout_s: float = 5.0  # per reward item
    scorer_workers: int = 2  # killable processes for non-sandbox rewards (math checking)

    def __post_init__(self):
        validate_literals(self)
        if self.num_workers < 0:
            raise ConfigError(f"rewards.num_workers: must be >= 0, got {self.num_workers}")
        check_positive("rewards", timeout_s=self.timeout_s, scorer_workers=self.scorer_workers)


PipelineMode = Literal["sync", "periodic", "async", "inflight"]
PIPELINE_MODES: tuple[str, ...] = typing.get_args(PipelineMode)


def lead_for(mode: str, max_staleness: int) -> int:
    """How many policy versions the generator may run ahead of the trainer in `mode`: 0 for
    `sync`, 1 for `periodic`, `max_staleness` for `async` and `inflight` (the run needs >= 1 there,
    which `PipelineConfig` checks; the planner also models k = 0)."""
    check_choice("pipeline", "mode", mode, PIPELINE_MODES)
    return {"sync": 0, "periodic": 1}.get(mode, max_staleness)


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How generation overlaps training (see jaxrl.rl.loop)."""

    mode: PipelineMode = "periodic"
    steps: int = 40  # RL updates in the run
    max_staleness: int = 2  # k for async / inflight (sync is 0, periodic 1 by construction)
    # beyond max_staleness: drop the group, or keep it with weight stale_weight ** (excess versions)
    stale_policy: Literal["drop", "downweight"] = "drop"
    stale_weight: float = 0.5
    max_oversample_rounds: int = 2  # extra prompt draws to replace zero-variance groups
    # "auto" (async / inflight): the lead, how many versions the generator may run ahead, moves
    # within 0..max_staleness with the measured drift between behaviour and current policy
    # (M2 of the log ratio against lead_tau; jaxrl.rl.lead); "fixed": max_staleness
    lead: Literal["fixed", "auto"] = "fixed"
    lead_tau: float = 0.04  # M2PO's tau
    # every this many steps, a few (prompt, completion, reward) samples go to TensorBoard (text)
    # and <run_dir>/samples.jsonl; 0 = off
    samples_every: int = 10
    # live rebalancing (jaxrl/rl/rebalance.py): "auto" moves chips between the trainer
    # and the generator at step boundaries when the measured rates say another split of the same
    # devices pays for the move (the policy of jaxrl/planner/rebalance.py); "off": the configured
    # split for the whole run. --resume starts again from the configured split.
    rebalance: Literal["off", "auto"] = "off"
    # the policy's patience: steps between two moves (and before the first), and consecutive
    # steps that must propose the same move before it is made
    rebalance_min_interval: int = 5
    rebalance_confirm: int = 3
    # seconds a move is assumed to cost until one is measured (pause plus recompilation); a move
    # must pay for it within 600 s or the time the run has left, whichever is shorter
    rebalance_cost_s: float = 30.0
    # seconds compiling a split ahead is assumed to take (and to cost the steps beside it) until
    # one is measured; None: the compile seconds of the run's own first step (its executables
    # compiled or loaded from the persistent cache), so a run whose compilation is slow against
    # its steps does not start one it cannot pay for
    rebalance_compile_s: float | None = None
    # for tests: force a move every this many steps (0: never), alternating between the
    # configured split and `rebalance_to` trainer chips (0: as many) on the devices in reverse
    # order, so that every forced move moves the state to other devices
    rebalance_every: int = 0
    rebalance_to: int = 0

    def __post_init__(self):
        validate_literals(self)
        check_positive("pipeline", steps=self.steps)
        if self.rebalance_every < 0 or self.rebalance_to < 0:
            raise ConfigError(f"pipeline.rebalance_every and pipeline.rebalance_to: must be >= 0 "
                              f"(0 = off / as configured), got {self.rebalance_every} and "
                              f"{self.rebalance_to}")
        if self.rebalance_min_interval < 0 or self.rebalance_confirm < 1:
            raise ConfigError(f"pipeline.rebalance_min_interval must be >= 0 and "
                              f"pipeline.rebalance_confirm >= 1, got "
                              f"{self.rebalance_min_interval} and {self.rebalance_confirm}")
        if not self.rebalance_cost_s >= 0:
            raise ConfigError(f"pipeline.rebalance_cost_s: must be >= 0 seconds, got "
                              f"{self.rebalance_cost_s}")
        if self.rebalance_compile_s is not None and not self.rebalance_compile_s >= 0:
            raise ConfigError(f"pipeline.rebalance_compile_s: must be >= 0 seconds or None "
                              f"(measured from the first step), got {self.rebalance_compile_s}")
        if self.max_staleness < 0 or self.max_oversample_rounds < 0:
            raise ConfigError(
                f"pipeline: max_staleness and max_oversample_rounds must be >= 0, got "
                f"{self.max_staleness} and {self.max_oversample_rounds}"
            )
        if self.samples_every < 0:
            raise ConfigError(
                f"pipeline.samples_every: must be >= 0 (0 = off), got {self.samples_every}")
        if self.mode in ("async", "inflight") and self.max_staleness < 1:
            raise ConfigError(
                f"pipeline.max_staleness: mode {self.mode!r} needs >= 1, got {self.max_staleness}"
            )
        if self.lead == "auto" and self.mode not in ("async", "inflight"):
            raise ConfigError(f"pipeline.lead='auto' needs mode 'async' or 'inflight' (its lead "
                              f"is fixed by construction), got mode {self.mode!r}")
        if not (math.isfinite(self.lead_tau) and self.lead_tau > 0):
            raise ConfigError(f"pipeline.lead_tau: must be a finite number > 0, got "
                              f"{self.lead_tau}")
        if not 0.0 < self.stale_weight <= 1.0:
            raise ConfigError(f"pipeline.stale_weight: must lie in (0, 1], got {self.stale_weight}")
        if self.mode == "periodic" and self.max_staleness < 1 and self.stale_policy == "drop":
            raise ConfigError(
                "pipeline.max_staleness=0 with mode 'periodic' and stale_policy 'drop' would drop "
                "every batch (periodic data is one version old); use stale_policy='downweight', "
                "mode='sync', or max_staleness >= 1"
            )


@dataclasses.dataclass(frozen=True)
class DistConfig:
    """Multi-process JAX (`jax.distributed`). Empty values: read from the environment, if any."""

    coordinator: str | None = None  # host:port of process 0
    num_processes: int | None = None
    process_id: int | None = None
    initialization_timeout_s: int = 120
    heartbeat_timeout_s: int = 60  # a peer silent this long is dead: every process stops

    def __post_init__(self):
        if self.num_processes is not None and self.num_processes < 1:
            raise ConfigError(f"dist.num_processes: must be >= 1, got {self.num_processes}")
        if self.process_id is not None and self.num_processes is not None:
            if not 0 <= self.process_id < self.num_processes:
                raise ConfigError(
                    f"dist.process_id: must be in [0, {self.num_processes}), got {self.process_id}"
                )


