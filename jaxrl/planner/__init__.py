"""jaxrl.planner: how to split chips between trainer and generator, before and after a run.

- `analytic`: rates of generator, trainer, weight sync and each pipeline mode (equations there).
- `recommend`: the split and mode that maximise consumed samples/s.
- `simulate`: discrete-event simulation of the pipeline, with a Perfetto trace.
- `measured`: a run's metrics.jsonl in, the recommended split out (`from_measured`).
- `published`: the published case the model reproduces. CLI: `python launch/plan.py`.

Plain Python + numpy; no JAX import. Names below load their module on first use.
"""

import importlib

_EXPORTS = {
    "ModelSpec": "specs", "Workload": "specs", "Efficiency": "specs", "get_model": "specs",
    "HardwareSpec": "hardware", "get_hardware": "hardware", "local_cpu": "hardware",
    "predict": "analytic", "pipeline_rates": "analytic", "MODES": "analytic",
    "Infeasible": "analytic",
    "Recommendation": "recommend", "recommend": "recommend",
    "recommend_analytic": "recommend",
    "SimConfig": "simulate", "simulate": "simulate", "simulate_split": "simulate",
    "from_measured": "measured", "read_run": "measured", "MeasuredRates": "measured",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str):
    if name not in _EXPORTS:
        raise AttributeError(f"module 'jaxrl.planner' has no attribute {name!r}")
    return getattr(importlib.import_module(f"jaxrl.planner.{_EXPORTS[name]}"), name)
