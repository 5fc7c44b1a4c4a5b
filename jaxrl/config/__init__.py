"""Experiment configuration: frozen dataclasses, experiment files, strict CLI overrides.

An experiment is a Python file in `configs/` with a function `config() -> RunConfig`. Overrides are
`--a.b=c` strings applied on top; an unknown key, a value of the wrong type or a value outside an
enum fails with a `ConfigError` that names the key, the valid choices and the value received.
Checks that span sections live in `jaxrl.config.checks` and run when a `RunConfig` is made.

    base.py       ConfigError (the one error type) and the shared checks
    sections.py   model, mesh, generate, rewards, pipeline (modes and their lead), dist
    data.py       data / task / SFT / evaluation;   train.py   the trainer
    run.py        RunConfig;   checks.py   cross-section checks;   overrides.py   files + overrides

This package imports no JAX, so sandbox workers and tools can read configs cheaply.
"""

from jaxrl.config.base import ConfigError, ConfigWarning, DTypeName, validate_literals
from jaxrl.config.data import DataConfig, DataConfigError, SFTConfig
from jaxrl.config.overrides import (
    apply_override,
    apply_overrides,
    load_config,
    parse_value,
    to_dict,
)
from jaxrl.config.run import RunConfig
from jaxrl.config.sections import (
    LORA_TARGETS,
    PIPELINE_MODES,
    Architecture,
    AttentionImpl,
    DistConfig,
    GenerateConfig,
    KVLayout,
    LoraConfig,
    MeshConfig,
    ModelConfig,
    PipelineConfig,
    PipelineMode,
    RewardsConfig,
    RopeScaling,
    lead_for,
)
from jaxrl.config.train import TrainConfig

__all__ = [
    "LORA_TARGETS", "PIPELINE_MODES", "Architecture", "AttentionImpl", "ConfigError",
    "ConfigWarning", "KVLayout",
    "LoraConfig",
    "DTypeName", "DataConfig", "DataConfigError", "DistConfig",
    "GenerateConfig", "MeshConfig", "ModelConfig", "PipelineConfig", "PipelineMode",
    "RewardsConfig", "RopeScaling", "RunConfig", "SFTConfig", "TrainConfig", "lead_for",
    "apply_override", "apply_overrides", "load_config", "parse_value",
    "to_dict", "validate_literals",
]
