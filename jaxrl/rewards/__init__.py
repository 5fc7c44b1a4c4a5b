"""jaxrl.rewards."""

# Sandbox pools (stdlib only; RaySandboxPool imports ray lazily, on first attribute access).
from jaxrl.rewards.pool import LocalSandboxPool
from jaxrl.rewards.types import SandboxJob, SandboxResult

__all__ = [  # noqa: F822 - RaySandboxPool comes from __getattr__
    "LocalSandboxPool", "RaySandboxPool", "SandboxJob", "SandboxResult", "RewardBatch",
    "RewardScorer", "RewardSpec", "RewardTerm", "get_reward", "register_reward", "reward_names",
    "KillableWorkers", "RewardTimeout", "WorkerError",
]


def __getattr__(name: str):
    if name == "RaySandboxPool":
        from jaxrl.rewards.ray_pool import RaySandboxPool

        return RaySandboxPool
    raise AttributeError(f"module 'jaxrl.rewards' has no attribute {name!r}")


# Rewards: registry, weighted combination, code_tests / math_answer / format (no jax imports).
from jaxrl.rewards.rewards import (  # noqa: E402
    RewardBatch,
    RewardScorer,
    RewardSpec,
    RewardTerm,
    get_reward,
    register_reward,
    reward_names,
)
from jaxrl.rewards.workers import KillableWorkers, RewardTimeout, WorkerError  # noqa: E402
