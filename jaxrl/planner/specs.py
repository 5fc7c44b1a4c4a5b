"""What the planner is told: the model, the workload and the efficiency assumptions.

Everything here is a frozen dataclass that checks its own values; presets are looked up by name
with `get_model`, and a bad name lists the valid ones.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import statistics
from collections.abc import Mapping

import numpy as np

_QUANTILES = 4096  # points of the deterministic quantile grid for response-length statistics


def _require(ok: bool, message: str) -> None:
    if not ok:
        raise ValueError(message)


@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """A decoder LLM, dense or mixture-of-experts.

    `kv_elems_per_token_layer` is the number of cached elements per token and layer; by default
    2 * kv_heads * head_dim (K and V); set it for latent attention (MLA caches one compressed
    vector, e.g. 512 + 64 rope dims). For MoE, `experts` / `experts_per_token` describe the routed
    experts; parameters outside them (attention, embeddings, shared experts) are always read.
    """

    name: str
    total_params: float
    active_params: float
    layers: int
    hidden: int
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 1
    experts_per_token: int = 1
    kv_elems_per_token_layer: int | None = None
    # sliding-window layers keep only `sliding_window` tokens of KV per sequence (the engine's
    # ring buffer, jaxrl.models.kv_cache); the other layers keep every token
    sliding_window: int | None = None
    sliding_layers: int = 0
    source: str = ""

    def __post_init__(self):
        _require(self.total_params > 0 and 0 < self.active_params <= self.total_params,
                 f"{self.name}: need 0 < active_params <= total_params, got "
                 f"active={self.active_params:g} total={self.total_params:g}")
        for field in ("layers", "hidden", "heads", "kv_heads", "head_dim", "vocab", "experts",
                      "experts_per_token"):
            _require(getattr(self, field) >= 1, f"{self.name}: {field} must be >= 1, got "
                     f"{getattr(self, field)}")
        _require(self.experts_per_token <= self.experts,
                 f"{self.name}: experts_per_token={self.experts_per_token} > "
                 f"experts={self.experts}")
        _require(self.experts > 1 or self.active_params == self.total_params,
                 f"{self.name}: a dense model (experts=1) needs active_params == total_params")
        _require(0 <= self.sliding_layers <= self.layers
                 and (self.sliding_layers == 0 or (self.sliding_window or 0) >= 1),
                 f"{self.name}: sliding_layers must lie in [0, layers={self.layers}] and need a "
                 f"sliding_window >= 1, got sliding_layers={self.sliding_layers}, "
                 f"sliding_window={self.sliding_window}")

    @property
    def _kv_elems_layer(self) -> int:
        return self.kv_elems_per_token_layer or 2 * self.kv_heads * self.head_dim

    @property
    def kv_elems_per_token(self) -> int:
        """Cached elements per token with every layer keeping it (no window)."""
        return self.layers * self._kv_elems_layer

    def kv_elems_per_sequence(self, tokens: float) -> float:
        """Cached elements of one sequence of `tokens` tokens: the full layers keep all, the
        sliding layers at most their window."""
        kept = min(tokens, self.sliding_window) if self.sliding_layers else tokens
        full = self.layers - self.sliding_layers
        return self._kv_elems_layer * (full * tokens + self.sliding_layers * kept)

    @property
    def routed_expert_params(self) -> float:
        """Parameters in all routed experts: active = shared + routed * k / E, solved for routed."""
        if self.experts == 1:
            return 0.0
        return (self.total_params - self.active_params) / (
            1.0 - self.experts_per_token / self.experts)

    def params_read(self, tokens: float) -> float:
        """Parameters a forward step over `tokens` tokens reads: the shared part always, each
        routed expert if at least one token picked it (uniform routing)."""
        routed = self.routed_expert_params
        if routed == 0.0 or tokens <= 0:
            return self.total_params - routed if tokens > 0 else 0.0
        untouched = (1.0 - self.experts_per_token / self.experts) ** tokens
        return self.total_params - routed * untouched

    def attention_flops_per_token(self, context: float) -> float:
        """Forward attention FLOPs of one token attending to `context` tokens (QK^T and AV)."""
        return 4.0 * self.layers * self.heads * self.head_dim * context


@dataclasses.dataclass(frozen=True)
class Workload:
    """One RL step's work.

    Response lengths are log-normal with mean `response_mean` and shape `response_sigma`
    (the long tail), truncated at `response_max` (the generation limit). `batch_size` counts
    samples (prompts * group_size) the trainer consumes per step; `updates_per_batch` optimizer
    steps split it into minibatches (it changes no FLOP count, only the minibatch size);
    `epochs` passes over the batch and `logprob_passes` extra forward passes (old-policy and/or
    reference log-probabilities) do. `zero_variance_frac` is the fraction of groups filtered
    out (all rewards equal) that must be regenerated. `sandbox_exec_s` is the mean time to score
    one sample on one CPU core (0: no sandbox). Multi-turn episodes: `turns_per_episode` model
    turns, each but the last ending in a tool call that holds one sandbox core for
    `tool_latency_s` on average; `sandbox_s_per_sample` adds them up.
    """

    prompt_len: int = 1024
    response_mean: float = 8192.0
    response_sigma: float = 0.8
    response_max: int = 32768
    group_size: int = 16
    batch_size: int = 1024
    updates_per_batch: int = 1
    epochs: int = 1
    logprob_passes: int = 1
    zero_variance_frac: float = 0.0
    sandbox_exec_s: float = 0.0
    prefix_sharing: bool = True
    turns_per_episode: float = 1.0
    tool_latency_s: float = 0.0

    def __post_init__(self):
        _require(self.prompt_len >= 1, f"prompt_len must be >= 1, got {self.prompt_len}")
        _require(1 <= self.response_mean <= self.response_max,
                 f"need 1 <= response_mean <= response_max, got {self.response_mean} and "
                 f"{self.response_max}")
        _require(self.response_sigma >= 0, f"response_sigma must be >= 0, got "
                 f"{self.response_sigma}")
        _require(self.group_size >= 1 and self.batch_size % self.group_size == 0,
                 f"batch_size ({self.batch_size}) must be a positive multiple of group_size "
                 f"({self.group_size})")
        _require(1 <= self.updates_per_batch <= self.batch_size,
                 f"updates_per_batch must be in [1, batch_size], got {self.updates_per_batch}")
        _require(self.epochs >= 1 and self.logprob_passes >= 0,
                 f"need epochs >= 1 and logprob_passes >= 0, got {self.epochs}, "
                 f"{self.logprob_passes}")
        _require(0 <= self.zero_variance_frac < 1,
                 f"zero_variance_frac must be in [0, 1), got {self.zero_variance_frac}")
        _require(self.sandbox_exec_s >= 0, f"sandbox_exec_s must be >= 0, got "
                 f"{self.sandbox_exec_s}")
        _require(self.turns_per_episode >= 1 and self.tool_latency_s >= 0,
                 f"need turns_per_episode >= 1 and tool_latency_s >= 0, got "
                 f"{self.turns_per_episode} and {self.tool_latency_s}")

    @property
    def tool_calls_per_sample(self) -> float:
        """Each turn but the last ends in a tool call."""
        return self.turns_per_episode - 1

    @property
    def sandbox_s_per_sample(self) -> float:
        """Sandbox core-seconds per sample: its tool calls, then its reward."""
        return self.tool_calls_per_sample * self.tool_latency_s + self.sandbox_exec_s

    @property
    def _mu(self) -> float:
        # Log-normal location for the untruncated mean; truncation lowers the mean slightly,
        # `response_stats` reports the truncated one.
        return math.log(self.response_mean) - self.response_sigma**2 / 2

    def sample_responses(self, rng: np.random.Generator, n: int) -> np.ndarray:
        """`n` response lengths (integers in [1, response_max])."""
        x = rng.lognormal(self._mu, self.response_sigma, size=n) if self.response_sigma else (
            np.full(n, self.response_mean))
        return np.clip(np.rint(x), 1, self.response_max).astype(np.int64)

    def response_quantile(self, q: float) -> float:
        z = statistics.NormalDist().inv_cdf(min(max(q, 1e-12), 1 - 1e-12))
        return float(min(max(math.exp(self._mu + self.response_sigma * z), 1.0),
                         self.response_max))

    def response_survival(self, x: float) -> float:
        """P(R > x) for the truncated distribution."""
        if x >= self.response_max:
            return 0.0
        if self.response_sigma == 0:
            return 1.0 if x < self.response_mean else 0.0
        if x <= 0:
            return 1.0
        return 1.0 - statistics.NormalDist().cdf((math.log(x) - self._mu) / self.response_sigma)

    def expected_longest(self, n: int) -> float:
        """E[max of `n` response lengths] = integral of 1 - (1 - P(R > x))^n over [0, max]."""
        return _expected_longest(self.response_mean, self.response_sigma, self.response_max, n)

    def response_stats(self) -> ResponseStats:
        return _response_stats(self.response_mean, self.response_sigma, self.response_max,
                               self.prompt_len)

    @property
    def groups_per_batch(self) -> int:
        return self.batch_size // self.group_size


@dataclasses.dataclass(frozen=True)
class ResponseStats:
    """Moments of the (truncated) response length R and the sample length T = prompt + R."""

    mean: float            # E[R]
    mean_sq: float         # E[R^2]
    sample_mean: float     # E[T]
    sample_mean_sq: float  # E[T^2]

    @property
    def resident_kv_tokens(self) -> float:
        """Average KV tokens a decode slot holds under continuous batching: prompt +
        E[R^2] / (2 E[R]) (a slot holds a response in proportion to its length, half grown)."""
        return (self.sample_mean - self.mean) + self.mean_sq / (2 * self.mean)


@functools.lru_cache(maxsize=4096)
def _expected_longest(mean: float, sigma: float, rmax: int, n: int, points: int = 1024) -> float:
    w = Workload(prompt_len=1, response_mean=mean, response_sigma=sigma, response_max=rmax,
                 group_size=1, batch_size=1)
    dx = rmax / points
    return sum(dx * (1.0 - (1.0 - w.response_survival((j + 0.5) * dx)) ** n)
               for j in range(points))


@functools.lru_cache(maxsize=256)
def _response_stats(mean: float, sigma: float, rmax: int, prompt: int) -> ResponseStats:
    w = Workload(prompt_len=prompt, response_mean=mean, response_sigma=sigma, response_max=rmax,
                 group_size=1, batch_size=1)
    q = (np.arange(_QUANTILES) + 0.5) / _QUANTILES
    r = np.array([w.response_quantile(x) for x in q])
    t = r + prompt
    return ResponseStats(float(r.mean()), float((r**2).mean()), float(t.mean()),
                         float((t**2).mean()))


@dataclasses.dataclass(frozen=True)
class Efficiency:
    """Assumptions the planner cannot derive: what fraction of peak each phase reaches.

    trainer_mfu: model FLOPs / peak while the trainer computes (not counting idle time).
    prefill_mfu: the same for prefill. decode_bw_eff: achieved / peak HBM bandwidth in decode;
    decode_mfu caps decode by compute when batches are large. sync_bw_eff: achieved / peak link
    bandwidth for weight sync, plus a fixed `sync_latency_s`. kv_mem_frac: HBM fraction the
    generator may fill (weights + KV cache). max_slots: decode slots per generator replica
    (scheduler limit). gen_bytes_per_param: weight precision on the generator (2 = bf16, 1 =
    fp8). train_bytes_per_param: trainer memory per parameter (bf16 weights and grads, fp32 master
    and two Adam moments = 16). sandbox_utilization: target busy fraction of sandbox cores.
    """

    trainer_mfu: float = 0.40
    prefill_mfu: float = 0.50
    decode_bw_eff: float = 0.60
    decode_mfu: float = 0.30
    sync_bw_eff: float = 0.50
    sync_latency_s: float = 0.05
    kv_mem_frac: float = 0.90
    max_slots: int = 256
    gen_bytes_per_param: float = 2.0
    train_bytes_per_param: float = 16.0
    sandbox_utilization: float = 0.8
    gen_replica_chips: int = 0
    count_attention: bool = True

    def __post_init__(self):
        for field in ("trainer_mfu", "prefill_mfu", "decode_bw_eff", "decode_mfu", "sync_bw_eff",
                      "kv_mem_frac", "sandbox_utilization"):
            v = getattr(self, field)
            _require(0 < v <= 1, f"{field} must be in (0, 1], got {v}")
        _require(self.sync_latency_s >= 0, f"sync_latency_s must be >= 0, got "
                 f"{self.sync_latency_s}")
        _require(self.max_slots >= 1, f"max_slots must be >= 1, got {self.max_slots}")
        _require(self.gen_replica_chips >= 0, f"gen_replica_chips must be >= 0, got "
                 f"{self.gen_replica_chips}")
        _require(self.gen_bytes_per_param > 0 and self.train_bytes_per_param > 0,
                 "bytes per parameter must be > 0")


def _qwen3_235b() -> ModelSpec:
    return ModelSpec(
        "qwen3-235b-a22b", total_params=235e9, active_params=22e9, layers=94, hidden=4096,
        heads=64, kv_heads=4, head_dim=128, vocab=151936, experts=128, experts_per_token=8,
        source="Qwen3 Technical Report (arXiv:2505.09388), table of MoE architectures; "
               "Qwen/Qwen3-235B-A22B config.json")


def _glm5() -> ModelSpec:
    return ModelSpec(
        "glm-5", total_params=744e9, active_params=40e9, layers=78, hidden=6144, heads=64,
        kv_heads=1, head_dim=192, vocab=154880, experts=256, experts_per_token=8,
        kv_elems_per_token_layer=512 + 64,
        source="GLM-5 technical report (arXiv:2602.15763), architecture table: 744B total, 40B "
               "activated, 3 dense + 75 MoE layers, MLA with KV LoRA dim 512 (+64 rope)")


MODELS: Mapping[str, ModelSpec] = {
    m.name: m
    for m in (
        _qwen3_235b(),
        _glm5(),
        ModelSpec("qwen3-8b", 8.2e9, 8.2e9, layers=36, hidden=4096, heads=32, kv_heads=8,
                  head_dim=128, vocab=151936, source="Qwen/Qwen3-8B config.json"),
        ModelSpec("qwen2.5-0.5b", 0.494e9, 0.494e9, layers=24, hidden=896, heads=14,
                  kv_heads=2, head_dim=64, vocab=151936,
                  source="Qwen/Qwen2.5-0.5B config.json"),
        # Parameter counts by ModelConfig.num_params of the config.json shapes (tied
        # embeddings, sandwich norms); the sliding layers' KV is their window, as the engine
        # keeps it (docs/models.md)
        ModelSpec("gemma3-1b", 999_885_952, 999_885_952, layers=26, hidden=1152, heads=4,
                  kv_heads=1, head_dim=256, vocab=262144, sliding_window=512, sliding_layers=22,
                  source="google/gemma-3-1b-it config.json (Gemma 3 release, 2025-03-12): 26 "
                         "layers, sliding window 512 on 5 of every 6"),
        ModelSpec("gemma2-2b", 2_614_341_888, 2_614_341_888, layers=26, hidden=2304, heads=8,
                  kv_heads=4, head_dim=256, vocab=256000, sliding_window=4096, sliding_layers=13,
                  source="google/gemma-2-2b config.json (Gemma 2 2B release, 2024-07-31): 26 "
                         "layers, sliding window 4096 on every other"),
        # The model of jaxrl's default experiment; a test keeps it in step.
        ModelSpec("tiny", 804992, 804992, layers=4, hidden=128, heads=4, kv_heads=2, head_dim=32,
                  vocab=128, source="configs/default.py (jaxrl's default CPU experiment)"),
    )
}


def get_model(name: str) -> ModelSpec:
    try:
        return MODELS[name]
    except KeyError:
        raise ValueError(f"unknown model preset {name!r}; valid: {sorted(MODELS)}") from None
