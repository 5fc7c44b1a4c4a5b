"""Held-out evaluation: pass@1 and pass@k with the generator, reported as metrics.

    metrics = evaluate(model, task, tokenizer, scorer, cfg=data_cfg, seed=step)
    # {"eval/pass@1": ..., "eval/pass@4": ..., "eval/reward_mean": ..., "eval/greedy_pass@1": ...}

Each of the task's `eval_size` held-out prompts gets n = `pass_k` samples at `eval_temperature`;
a sample is correct when its reward >= `correct_threshold`. pass@k is the unbiased estimator of
Chen et al. 2021 (Codex, eq. 1): with c correct of n samples,

    pass@k = E_prompts[ 1 - C(n - c, k) / C(n, k) ]

(pass@1 reduces to the mean of c / n). `greedy=True` adds one temperature-0 sample per prompt.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping, Sequence

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


def decode_completions(tokenizer, completions) -> list[str]:
    # errors="replace": a model's padded vocabulary can sample ids the tokenizer does not know
    return [tokenizer.decode(list(c.tokens), errors="replace") for c in completions]


def sample_texts(model, tokenizer, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int,
                 temperature: float, seed: int, mesh=None) -> list[str]:
    """`n` completions per prompt (prompt-major), decoded, EOS stripped."""
    from jaxrl.generate import SamplingParams, sample

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n, seed=seed)
    comps = sample(model, [list(p) for p in prompts], params, mesh=mesh,
                   eos_ids=(tokenizer.eos_id,))
    return decode_completions(tokenizer, comps)


def evaluate(model, task, tokenizer, scorer, *, cfg, records: Sequence[Mapping] | None = None,
             seed: int = 0, mesh=None, greedy: bool = True, correct_threshold: float = 1.0,
             prefix: str = "eval") -> dict[str, float]:
    """pass@1 / pass@k (and greedy pass@1) of `model` on held-out prompts; returns metrics.

    Args:
      model: a `Transformer` (or what `jaxrl.generate.sample` accepts).
      task / tokenizer: the run's task and tokenizer; prompts use `cfg.prompt_format`.
      scorer: a `jaxrl.rewards.RewardScorer` built from `task.reward_spec()`.
      cfg: the DataConfig (eval_size, pass_k, eval_temperature, max_new_tokens).
      records: override the held-out records (default `task.eval_records(cfg.eval_size)`).
      seed: sampling seed (use the step so evaluations differ but runs reproduce).
    """
    t0 = time.perf_counter()
    records = list(records if records is not None else task.eval_records(cfg.eval_size))
    prompts = [task.render(r, tokenizer, cfg.prompt_format) for r in records]
    n = cfg.pass_k
    texts = sample_texts(model, tokenizer, prompts, n=n, max_tokens=cfg.max_new_tokens,
                         temperature=cfg.eval_temperature, seed=seed, mesh=mesh)
    expanded = [r for r in records for _ in range(n)]
    scored = scorer.score_batch(task.reward_items(expanded, texts))
    rewards_PxN = np.asarray(scored.total, dtype=np.float64).reshape(len(records), n)
    metrics = pass_at_k_metrics(rewards_PxN >= correct_threshold, (1, n), prefix)
    metrics[f"{prefix}/reward_mean"] = float(rewards_PxN.mean())
    metrics[f"{prefix}/prompts"] = float(len(records))
    metrics[f"{prefix}/reward_errors"] = float(sum(scored.errors.values()))
    if greedy:
        g_texts = sample_texts(model, tokenizer, prompts, n=1, max_tokens=cfg.max_new_tokens,
                               temperature=0.0, seed=seed, mesh=mesh)
        g = scorer.score_batch(task.reward_items(records, g_texts))
        metrics[f"{prefix}/greedy_pass@1"] = float(
            np.mean(np.asarray(g.total) >= correct_threshold))
    metrics[f"{prefix}/time_s"] = time.perf_counter() - t0
    return metrics


def should_evaluate(step: int, cfg, final: bool = False) -> bool:
    """True at the end of a run and every `cfg.eval_every` steps (if > 0)."""
    return final or (cfg.eval_every > 0 and step > 0 and step % cfg.eval_every == 0)
