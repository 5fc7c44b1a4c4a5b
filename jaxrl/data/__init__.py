"""jaxrl.data: prompt sources, tasks, dynamic sampling and the pass@k maths (a leaf: it imports
no other jaxrl package but `jaxrl.config`).

Nothing is imported here (import cost matters); use the modules:

    from jaxrl.config import DataConfig, SFTConfig             # --data.* settings (no jax)
    from jaxrl.data.tasks import build_task                    # task = build_task(cfg.data)
    from jaxrl.data.pipeline import prompt_iterator            # batches of records, JSON state
    from jaxrl.data.solve_rate import SolveRateTracker         # zero-variance / skip helpers
    from jaxrl.data.evaluate import pass_at_k, eval_metrics    # pass@1 / pass@k, one schema

The SFT warm start is `jaxrl.train.sft`; evaluators that sample are `jaxrl.rl.evaluator`.
See docs/tasks.md.
"""
