"""jaxrl.rewards: the reward registry and scorer (`rewards.py`), `code/` (the `code_tests` judge and
test formats), `math/` (`math_answer`'s parsing); no jax. The sandbox runtime's names below are
`jaxrl.sandbox`'s, also importable from here."""

from jaxrl import sandbox as _sandbox
from jaxrl.rewards.rewards import (
    RewardBatch,
    RewardScorer,
    RewardSpec,
    RewardTerm,
    get_reward,
    register_reward,
    reward_names,
)

_FROM_SANDBOX = ("LocalSandboxPool", "RaySandboxPool", "SandboxJob", "SandboxResult",
                 "KillableWorkers", "RewardTimeout", "WorkerError")
__all__ = [*_FROM_SANDBOX, "RewardBatch", "RewardScorer", "RewardSpec", "RewardTerm", "get_reward",
           "register_reward", "reward_names"]


def __getattr__(name: str):  # RaySandboxPool imports ray only when it is asked for
    if name in _FROM_SANDBOX:
        return getattr(_sandbox, name)
    raise AttributeError(f"module 'jaxrl.rewards' has no attribute {name!r}")
