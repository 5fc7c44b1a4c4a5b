"""Generation: a JetStream-shaped engine, continuous batching, sampling with behaviour logprobs.

    from jaxrl.generate import sample, SamplingParams
    completions = sample(model, [[1, 2, 3]], SamplingParams(max_tokens=32, temperature=0.7, n=4))

Lower level: `JaxEngine` (prefill / insert / generate / set_params) and `Scheduler`
(submit / step / run). See docs/generate.md.
"""

from jaxrl.generate.api import sample
from jaxrl.generate.engine import DecodeState, Engine, JaxEngine, Prefix, StepResult, Weights
from jaxrl.generate.sampling import SamplingParams
from jaxrl.generate.scheduler import Completion, GenerateStats, Scheduler

__all__ = ["Completion", "DecodeState", "Engine", "GenerateStats", "JaxEngine", "Prefix",
           "SamplingParams", "Scheduler", "StepResult", "Weights", "sample"]
