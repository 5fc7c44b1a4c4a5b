"""The data section of the config; it lives in `jaxrl.config.data` (one config layer). This name
stays importable for experiment files written against it."""

from jaxrl.config.data import (  # noqa: F401
    BUILTIN_TASKS,
    SPLITS,
    DataConfig,
    DataConfigError,
    PromptFormat,
    SFTConfig,
    Split,
    task_names,
)
from jaxrl.presets import tiny_task_model_config  # noqa: F401  (moved; the old name still works)
