"""jaxrl.data: prompt sources, tasks, dynamic sampling, evaluation and the SFT warm start.

Nothing is imported here (import cost matters); use the modules:

    from jaxrl.data.config import DataConfig, SFTConfig        # --data.* settings (no jax)
    from jaxrl.data.tasks import build_task                    # task = build_task(cfg.data)
    from jaxrl.data.pipeline import prompt_iterator            # batches of records, JSON state
    from jaxrl.data.solve_rate import SolveRateTracker         # zero-variance / skip helpers
    from jaxrl.data.evaluate import evaluate, should_evaluate  # pass@1 / pass@k
    from jaxrl.data.sft import warm_start                      # cached SFT warm start

See docs/tasks.md.
"""
