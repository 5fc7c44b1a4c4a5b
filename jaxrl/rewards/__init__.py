"""jaxrl.rewards."""

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
