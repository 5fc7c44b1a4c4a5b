"""`RunConfig`: one experiment, every section (checks that span sections: `jaxrl.config.checks`)."""

from __future__ import annotations

import dataclasses
from pathlib import Path

from jaxrl.config.base import ConfigError
from jaxrl.config.checks import check_run, checks_deferred
from jaxrl.config.data import DataConfig
from jaxrl.config.sections import (
    DistConfig,
    GenerateConfig,
    MeshConfig,
    ModelConfig,
    PipelineConfig,
    RewardsConfig,
)
from jaxrl.config.train import TrainConfig


@dataclasses.dataclass(frozen=True)
class RunConfig:
    """One experiment: every section, with defaults for the CPU demo."""

    name: str = "default"
    seed: int = 0
    run_dir: str = "runs"
    init: str | None = None  # HF model to start from: local directory or Hub id (org/name,
    #   from the local HF cache; downloaded when online); None = random init (+ SFT)
    tokenizer: str = "auto"  # "auto" = the model's own when `init` is set, else "char";
    #   "char", a local HF tokenizer directory, or a Hub id
    model: ModelConfig = dataclasses.field(default_factory=ModelConfig)
    mesh: MeshConfig = dataclasses.field(default_factory=MeshConfig)
    train: TrainConfig = dataclasses.field(default_factory=TrainConfig)
    data: DataConfig = dataclasses.field(default_factory=DataConfig)
    generate: GenerateConfig = dataclasses.field(default_factory=GenerateConfig)
    rewards: RewardsConfig = dataclasses.field(default_factory=RewardsConfig)
    pipeline: PipelineConfig = dataclasses.field(default_factory=PipelineConfig)
    dist: DistConfig = dataclasses.field(default_factory=DistConfig)
    # XLA's persistent compilation cache: a run compiles what an earlier one did not (a restart,
    #   a resume, a live move to a split met before load their executables); "" = off. The
    #   JAX_COMPILATION_CACHE_DIR environment variable, when set, wins.
    compile_cache: str = "~/.cache/jaxrl/xla"
    preemption_grace_s: float = 30.0  # after SIGTERM / Ctrl-C, the seconds in which the run
    #   finishes its step and checkpoints it (cloud preemption notices give ~30 s); 0 = stop at
    #   once, keeping the last periodic checkpoint (docs/survival.md)

    def __post_init__(self):
        if not self.preemption_grace_s >= 0:  # NaN too
            raise ConfigError(f"preemption_grace_s={self.preemption_grace_s!r} is not valid; "
                              f"it must be a number of seconds >= 0")
        if not checks_deferred():
            check_run(self)

    def validate(self) -> RunConfig:
        """The checks that span sections (`jaxrl.config.checks`); returns self."""
        check_run(self)
        return self

    @property
    def path(self) -> Path:
        return Path(self.run_dir) / self.name


