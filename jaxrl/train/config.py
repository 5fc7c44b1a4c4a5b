"""The trainer section of the config; it lives in `jaxrl.config.train` (one config layer). This
name stays importable for experiment files written against it."""

from jaxrl.config.train import (  # noqa: F401
    ADVANTAGE_NAMES,
    AGGREGATION_NAMES,
    CORRECTION_NAMES,
    KL_ESTIMATOR_NAMES,
    NAN_POLICIES,
    POLICY_LOSS_NAMES,
    REMAT_NAMES,
    SCHEDULE_NAMES,
    TrainConfig,
)
