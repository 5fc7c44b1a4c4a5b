"""Held-out evaluation with the generator: one schema (`jaxrl.data.evaluate.eval_metrics`).

    evaluator = Evaluator(producer, task, data_cfg, processes, seed=cfg.seed)
    evaluator(step, on_generator=loop.call_on_generator)    # the run's engine
    evaluate(model, task, tokenizer, scorer, cfg=data_cfg)   # a bare model (e.g. after SFT)

A run evaluates on its own engine with the newest published weights; while the loop runs the
work is handed to the generator thread between batches (`Loop.call_on_generator`), so there is
never a second engine or a recompilation. Several processes each evaluate their share of the
records.
"""

from __future__ import annotations

import time
from collections.abc import Mapping, Sequence

import numpy as np

from jaxrl.data.evaluate import eval_metrics
from jaxrl.progress import Progress


class Evaluator:
    def __init__(self, producer, task, data_cfg, processes, *, seed: int,
                 progress: bool = True):
        self.producer, self.task, self.cfg = producer, task, data_cfg
        self.processes, self.seed = processes, seed
        self.progress = progress  # a progress display (process 0) while evaluating

    def __call__(self, step: int, *, on_generator) -> dict[str, float]:
        records = self.task.eval_records(self.cfg.eval_size)
        start, stop = self.processes.eval_share(len(records))
        mine = records[start:stop]
        bar = Progress(f"eval@{step}", len(mine) * (self.cfg.pass_k + 1), unit="sample",
                       enabled=self.progress and self.processes.leader, min_interval=10.0,
                       announce=True)

        def evaluate(generator, weights) -> dict:
            if weights is not None:  # the newest published weights
                self.producer.install(generator.scheduler, weights)
            return self.producer.evaluate(generator.scheduler, mine, pass_k=self.cfg.pass_k,
                                          temperature=self.cfg.eval_temperature,
                                          seed=self.seed + step, index_offset=start,
                                          on_sample=bar.update)

        metrics = {}
        try:
            if mine:
                metrics = on_generator(evaluate)
        finally:
            bar.close()
        return self.processes.combine_evals(len(mine), metrics)


def decode_completions(tokenizer, completions) -> list[str]:
    # errors="replace": a model's padded vocabulary can sample ids the tokenizer does not know
    return [tokenizer.decode(list(c.tokens), errors="replace") for c in completions]


def sample_texts(model, tokenizer, prompts: Sequence[Sequence[int]], *, n: int, max_tokens: int,
                 temperature: float, seed: int, mesh=None) -> list[str]:
    """`n` completions per prompt (prompt-major), decoded, EOS stripped."""
    from jaxrl.generate import SamplingParams, sample

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, n=n, seed=seed)
    comps = sample(model, [list(p) for p in prompts], params, mesh=mesh,
                   eos_ids=tokenizer.eos_ids)
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
    errors = sum(scored.errors.values())
    greedy_P = None
    if greedy:
        g_texts = sample_texts(model, tokenizer, prompts, n=1, max_tokens=cfg.max_new_tokens,
                               temperature=0.0, seed=seed, mesh=mesh)
        g = scorer.score_batch(task.reward_items(records, g_texts))
        greedy_P, errors = np.asarray(g.total), errors + sum(g.errors.values())
    return eval_metrics(rewards_PxN, greedy_P, errors=errors, seconds=time.perf_counter() - t0,
                        correct_threshold=correct_threshold, prefix=prefix)


