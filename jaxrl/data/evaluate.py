"""Held-out evaluation maths: pass@k and the one metric schema of every evaluation.

(The evaluators that sample: `jaxrl.rl.evaluator`.) Each held-out prompt gets n =
`pass_k` samples at `eval_temperature`; a sample is correct when its reward >=
`correct_threshold`. pass@k is the unbiased estimator of Chen et al. 2021 (Codex, eq. 1): with c
correct of n samples,

    pass@k = E_prompts[ 1 - C(n - c, k) / C(n, k) ]

(pass@1 reduces to the mean of c / n). `greedy=True` adds one temperature-0 sample per prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased pass@k for one prompt with c correct out of n samples: 1 - C(n-c,k)/C(n,k)."""
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k needs 0 <= c <= n and 1 <= k <= n; got n={n}, c={c}, k={k}")
    if n - c < k:
        return 1.0
    return 1.0 - math.comb(n - c, k) / math.comb(n, k)


def pass_at_k_metrics(correct_PxN, ks: Sequence[int], prefix: str = "eval") -> dict[str, float]:
    """Mean pass@k over prompts from a bool [prompts, n] table of correct samples."""
    c = np.asarray(correct_PxN, dtype=bool)
    if c.ndim != 2 or c.shape[0] == 0:
        raise ValueError(f"correct must be [prompts, samples] with prompts > 0, got {c.shape}")
    n = c.shape[1]
    counts = c.sum(axis=1)
    return {f"{prefix}/pass@{k}": float(np.mean([pass_at_k(n, int(x), k) for x in counts]))
            for k in sorted(set(ks)) if k <= n}


def eval_metrics(rewards_PxN, greedy_P=None, *, errors: int = 0, seconds: float = 0.0,
                 correct_threshold: float = 1.0, prefix: str = "eval") -> dict[str, float]:
    """The one schema of an evaluation: `{prefix}/pass@1`, `/pass@{n}`, `/reward_mean`,
    `/prompts`, `/reward_errors`, `/greedy_pass@1` (when `greedy_P` is given) and `/time_s`,
    from the [prompts, n] rewards of the samples (and the greedy sample's rewards)."""
    rewards = np.asarray(rewards_PxN, np.float64)
    metrics = pass_at_k_metrics(rewards >= correct_threshold, (1, rewards.shape[1]), prefix)
    metrics[f"{prefix}/reward_mean"] = float(rewards.mean())
    metrics[f"{prefix}/prompts"] = float(rewards.shape[0])
    metrics[f"{prefix}/reward_errors"] = float(errors)
    if greedy_P is not None:
        metrics[f"{prefix}/greedy_pass@1"] = float(
            np.mean(np.asarray(greedy_P) >= correct_threshold))
    metrics[f"{prefix}/time_s"] = float(seconds)
    return metrics


def should_evaluate(step: int, cfg, final: bool = False) -> bool:
    """True at the end of a run and every `cfg.eval_every` steps (if > 0)."""
    return final or (cfg.eval_every > 0 and step > 0 and step % cfg.eval_every == 0)
