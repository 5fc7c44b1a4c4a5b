"""The Python entry point: GRPO on your records with your reward functions, in a few lines.

    from jaxrl.api import train
    from jaxrl.config import RunConfig

    def exact(prompt, completion, answer, **_):     # any fields of the record arrive by name
        return float(completion.strip() == answer)

    result = train(RunConfig(name="mine"), dataset=[{"prompt": "2+3=", "answer": "5"}, ...],
                   reward_fns=[exact])
    result.eval_end["eval/pass@1"], result.run_dir

`dataset` (and `eval_dataset`) is a list of dicts, a Hugging Face `datasets.Dataset` (anything
iterable of dicts), or JSONL / Parquet path(s); records are mapped to prompts as the `records`
task does (`config.data.prompt_field` / `prompt_template` / `answer_field` / `tests_field`,
see docs/tasks.md). Each reward function is `fn(prompt, completion, **fields) -> float`, run on
the host in the trainer's process (a raised error or a non-number scores 0 and is counted, never
stopping the run; a hang cannot be timed out there: rewards that execute model-written code
belong in the sandbox pool, e.g. the built-in `code_tests`, named in `builtin_rewards`).
Without `eval_dataset` the last `config.data.eval_size` records are held out. Returns
`jaxrl.run.RunResult`.

`resume=True` continues `run_dir/name` from its newest checkpoint with the config given here
(the same records give the same task name); a config whose model differs from the run's saved
config.json is refused naming the keys. The run directory exports and samples like any other
(`launch/export.py`, `python -m jaxrl.generate`): neither needs the task this call registered.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

import jaxrl.run
from jaxrl.config import ConfigError, RunConfig
from jaxrl.data import tasks
from jaxrl.data.sources import load_records
from jaxrl.rewards import register_reward

RewardFn = Callable[..., float]


def _records(data: Any, what: str) -> list[dict] | None:
    if data is None:
        return None
    if isinstance(data, (str, os.PathLike)) or (
            isinstance(data, Sequence) and data and isinstance(data[0], (str, os.PathLike))):
        paths = [data] if isinstance(data, (str, os.PathLike)) else list(data)
        return list(load_records(paths, name=what))
    if not isinstance(data, Iterable):
        raise ConfigError(f"{what}: expected a list of dicts, a datasets.Dataset or JSONL / "
                          f"Parquet path(s), got {type(data).__name__}")
    out = [dict(r) for r in data]
    if not out or not all(isinstance(r, Mapping) for r in out):
        raise ConfigError(f"{what}: expected a non-empty iterable of dict records")
    return out


def train(config: RunConfig, *, dataset: Any, reward_fns: Sequence[RewardFn] = (),
          builtin_rewards: Mapping[str, float] | None = None, eval_dataset: Any = None,
          resume: bool = False, progress: bool = True, evaluate: bool = True):
    """Run GRPO (or whatever `config.train` says) on `dataset`, scored by `reward_fns` (weight 1
    each, summed) plus `builtin_rewards` ({registered name: weight}). See the module docstring."""
    train_records = _records(dataset, "dataset")
    eval_records = _records(eval_dataset, "eval_dataset")
    if not reward_fns and not builtin_rewards:
        raise ConfigError("train(): give reward_fns (callables fn(prompt, completion, **fields) "
                          "-> float) and/or builtin_rewards ({'math_answer': 1.0, ...})")
    weights = dict(builtin_rewards or {})
    for fn in reward_fns:
        if not callable(fn):
            raise ConfigError(f"reward_fns: {fn!r} is not callable")
        name = f"api/{getattr(fn, '__name__', 'reward')}"
        if name in weights:
            raise ConfigError(f"reward_fns: two functions are named {name!r}; rename one")
        register_reward(name, isolated=False, overwrite=True)(fn)
        weights[name] = 1.0
    # the name covers the records' content: the SFT cache key names the task, not the records
    digest = hashlib.sha256(json.dumps([config.name, train_records, eval_records,
                                        sorted(weights)], sort_keys=True, default=str).encode())
    task_name = f"api_{config.name}_{digest.hexdigest()[:8]}"

    @tasks.register_task(task_name, overwrite=True)
    def _build(cfg):
        return tasks.records_task(cfg, train=train_records, eval=eval_records, name=task_name,
                                  rewards=weights)

    cfg = dataclasses.replace(config, data=dataclasses.replace(config.data, task=task_name))
    return jaxrl.run.run(cfg, resume=resume, progress=progress, evaluate=evaluate)
