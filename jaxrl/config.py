"""Experiment configuration: frozen dataclasses, experiment files, strict CLI overrides.

An experiment is a Python file in `configs/` with a function `config() -> RunConfig`. Overrides are
`--a.b=c` strings applied on top; an unknown key, a value of the wrong type or a value outside an
enum fails with a message that names the key, the valid choices and the value received.

This module imports no JAX, so sandbox workers and tools can read configs cheaply.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from pathlib import Path
from typing import Any, Literal

from jaxrl.data.config import DataConfig
from jaxrl.train.config import TrainConfig

DTypeName = Literal["float32", "bfloat16", "float16"]
AttentionImpl = Literal["xla", "pallas", "cudnn", "auto"]
Architecture = Literal["llama", "qwen2", "qwen3"]
KVLayout = Literal["contiguous", "paged"]


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message says which and what is allowed."""


def _check_choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(
            f"{owner}.{name}: invalid value {value!r}; valid choices: {list(choices)}"
        )


def _check_positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{owner}.{name}: must be > 0, got {value!r}")


def _literal_choices(tp: Any) -> tuple | None:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def validate_literals(obj: Any) -> None:
    """Check every `Literal[...]` field of a dataclass instance against its choices."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        choices = _literal_choices(hints[f.name])
        if choices is not None:
            _check_choice(type(obj).__name__, f.name, getattr(obj, f.name), choices)


@dataclasses.dataclass(frozen=True)
class RopeScaling:
    """Llama-3 style RoPE frequency scaling (`rope_type: llama3` in HF configs)."""

    factor: float = 8.0
    low_freq_factor: float = 1.0
    high_freq_factor: float = 4.0
    original_max_position_embeddings: int = 8192


@dataclasses.dataclass(frozen=True)
class ModelConfig:
    """A decoder-only transformer of the Llama / Qwen2 / Qwen3 family."""

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
    dtype: DTypeName = "float32"  # compute dtype
    param_dtype: DTypeName = "float32"  # storage dtype
    attention_impl: AttentionImpl = "auto"
    remat: bool = False  # rematerialise each decoder layer in the backward pass

    def __post_init__(self):
        validate_literals(self)
        _check_positive(
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

    @property
    def head_size(self) -> int:
        return self.head_dim if self.head_dim is not None else self.hidden_size // self.num_heads

    def num_params(self, include_embeddings: bool = True) -> int:
        """Parameter count (used for FLOP estimates)."""
        e, f, d = self.hidden_size, self.intermediate_size, self.head_size
        attn = e * d * (self.num_heads * 2 + self.num_kv_heads * 2)
        if self.qkv_bias:
            attn += d * (self.num_heads + 2 * self.num_kv_heads)
        if self.qk_norm:
            attn += 2 * d
        if self.o_bias:
            attn += e
        layer = attn + 3 * e * f + 2 * e
        total = self.num_layers * layer + e
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


@dataclasses.dataclass(frozen=True)
class GenerateConfig:
    """The generator engine and its sampling settings (group size and lengths live in `data`)."""

    num_slots: int = 64  # concurrent samples (decode batch) on the generator mesh
    # KV-cache length per slot. 0 = automatic: 1.5x the longest of 64 held-out prompts + 8, plus
    # data.max_new_tokens, rounded up to a power of two; a longer prompt is rejected, so set it
    # explicitly for datasets with long prompts.
    max_len: int = 0
    chunk_steps: int = 16  # decode steps per host round trip
    temperature: float = 1.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0
    dtype: DTypeName | None = None  # cast weights to this dtype on sync (None: trainer's dtype)
    # KV cache: one [slots, max_len] row per slot, or pages of `page_size` positions read through
    # a page table (paged decode attention; see docs/generate.md)
    kv_layout: KVLayout = "contiguous"
    page_size: int = 16  # positions per page (kv_layout="paged"; the GPU kernel needs 2^k >= 16)

    def __post_init__(self):
        _check_choice("generate", "kv_layout", self.kv_layout, typing.get_args(KVLayout))
        validate_literals(self) if self.dtype is not None else None
        _check_positive("generate", num_slots=self.num_slots, chunk_steps=self.chunk_steps,
                        page_size=self.page_size)
        if self.max_len < 0:
            raise ConfigError(f"generate.max_len: must be >= 0 (0 = automatic), got {self.max_len}")
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
    tier: Literal["auto", "A", "B"] = "auto"  # isolation tier (see jaxrl.rewards.sandbox)
    timeout_s: float = 5.0  # per reward item
    scorer_workers: int = 2  # killable processes for non-sandbox rewards (math checking)

    def __post_init__(self):
        validate_literals(self)
        if self.num_workers < 0:
            raise ConfigError(f"rewards.num_workers: must be >= 0, got {self.num_workers}")
        _check_positive("rewards", timeout_s=self.timeout_s, scorer_workers=self.scorer_workers)


PipelineMode = Literal["sync", "periodic", "async", "inflight"]


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
    """How generation overlaps training (see jaxrl.controller.pipeline)."""

    mode: PipelineMode = "periodic"
    steps: int = 40  # RL updates in the run
    max_staleness: int = 2  # k for async / inflight (sync is 0, periodic 1 by construction)
    # beyond max_staleness: drop the group, or keep it with weight stale_weight ** (excess versions)
    stale_policy: Literal["drop", "downweight"] = "drop"
    stale_weight: float = 0.5
    max_oversample_rounds: int = 2  # extra prompt draws to replace zero-variance groups
    log_every: int = 1

    def __post_init__(self):
        validate_literals(self)
        _check_positive("pipeline", steps=self.steps, log_every=self.log_every)
        if self.max_staleness < 0 or self.max_oversample_rounds < 0:
            raise ConfigError(
                f"pipeline: max_staleness and max_oversample_rounds must be >= 0, got "
                f"{self.max_staleness} and {self.max_oversample_rounds}"
            )
        if self.mode in ("async", "inflight") and self.max_staleness < 1:
            raise ConfigError(
                f"pipeline.max_staleness: mode {self.mode!r} needs >= 1, got {self.max_staleness}"
            )
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


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One experiment: every section, with defaults for the CPU demo."""

    name: str = "default"
    seed: int = 0
    run_dir: str = "runs"
    init: str | None = None  # local HF directory to start from; None = random init (+ SFT)
    tokenizer: str = "char"  # "char" or a local HF tokenizer directory
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    generate: GenerateConfig = dataclasses.field(default_factory=GenerateConfig)
    rewards: RewardsConfig = dataclasses.field(default_factory=RewardsConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / self.name


# ----------------------------------------------------------------------------- overrides


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)) and len(args) == 1:
            return args[0], True
    return tp, False


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_value(key: str, text: str, tp: Any) -> Any:
    """Parse `text` as a value of type `tp` for `key`, or raise ConfigError."""
    inner, optional = _strip_optional(tp)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    choices = _literal_choices(inner)
    if choices is not None:
        if text not in [str(c) for c in choices]:
            raise ConfigError(f"--{key}: invalid value {text!r}; valid choices: {list(choices)}")
        return next(c for c in choices if str(c) == text)
    if inner is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"--{key}: expected a boolean (true/false), got {text!r}")
    if inner in (int, float, str):
        if inner is str:
            return text
        try:
            return inner(text)
        except ValueError:
            raise ConfigError(f"--{key}: expected {inner.__name__}, got {text!r}") from None
    if typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        elem = args[0] if args else str
        parts = [p for p in text.replace("x", ",").strip("()[] ").split(",") if p.strip()]
        if elem is str:
            parts = [p for p in text.strip("()[] ").split(",") if p.strip()]
        return tuple(parse_value(key, p.strip(), elem) for p in parts)
    if dataclasses.is_dataclass(inner):
        raise ConfigError(f"--{key}: is a section; set its fields, e.g. --{key}.<field>=...")
    raise ConfigError(f"--{key}: cannot parse values of type {inner!r}")


def _field_map(obj: Any) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(obj)}


def apply_override(cfg: Any, key: str, text: str, _prefix: str = "") -> Any:
    """Return a copy of `cfg` with the dotted `key` set from `text`."""
    head, _, rest = key.partition(".")
    full = _prefix + head
    fields = _field_map(cfg)
    if head not in fields:
        raise ConfigError(
            f"--{_prefix}{key}: unknown key {head!r} in {type(cfg).__name__}; "
            f"valid keys: {sorted(fields)}"
        )
    _, tp = fields[head]
    current = getattr(cfg, head)
    if rest:
        inner, _ = _strip_optional(tp)
        if not dataclasses.is_dataclass(inner):
            raise ConfigError(f"--{_prefix}{key}: {full!r} is a value, not a section")
        if current is None:
            current = inner()
        new = apply_override(current, rest, text, _prefix=full + ".")
    else:
        new = parse_value(full, text, tp)
    try:
        return dataclasses.replace(cfg, **{head: new})
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--{_prefix}{key}={text}: {e}") from None


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply `--a.b=c` (or `a.b=c`) strings in order."""
    for item in overrides:
        body = item[2:] if item.startswith("--") else item
        if "=" not in body:
            raise ConfigError(f"override {item!r} must look like --key.sub=value")
        key, text = body.split("=", 1)
        cfg = apply_override(cfg, key.strip(), text)
    return cfg


def load_config(path: str | Path, overrides: list[str] | None = None) -> Any:
    """Load `config()` from an experiment file and apply overrides."""
    path = Path(path)
    if not path.is_file():
        shipped = sorted(p.name for p in Path(__file__).parent.parent.glob("configs/*.py"))
        raise ConfigError(f"config file {str(path)!r} not found; shipped configs: {shipped}")
    spec = importlib.util.spec_from_file_location(f"_jaxrl_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "config", None)):
        raise ConfigError(f"{path}: must define a function `config()` returning a RunConfig")
    cfg = module.config()
    if not dataclasses.is_dataclass(cfg):
        raise ConfigError(f"{path}: config() returned {type(cfg).__name__}, not a config dataclass")
    return apply_overrides(cfg, overrides or [])


def to_dict(cfg: Any) -> dict:
    """A JSON-friendly dict of a config (for run directories and cache keys)."""
    return dataclasses.asdict(cfg)
