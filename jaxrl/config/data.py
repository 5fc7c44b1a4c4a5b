"""Data / task / SFT / evaluation configuration (frozen dataclasses, no jax import).

    DataConfig(task="pysynth", difficulty=1, prompts_per_step=8, group_size=8)
    --data.task=gsm8k_jsonl --data.paths=/data/gsm8k/train.jsonl --data.eval_paths=/data/test.jsonl
    --data.sft.steps=300 --data.eval_every=20 --data.pass_k=4

Every invalid value fails in `__post_init__` with the field, the value received and what is allowed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import threading
from typing import Any, Literal

from jaxrl.config.base import ConfigError, check

PromptFormat = Literal["auto", "plain", "chat"]
Split = Literal["train", "eval"]
SPLITS: tuple[str, ...] = ("train", "eval")


BUILTIN_TASKS: tuple[str, ...] = ("arith", "code_feedback", "gsm8k_jsonl", "lookup", "pysynth",
                                  "python_tool", "records")


_TASK_NAMES: set[str] = set(BUILTIN_TASKS)  # and those `jaxrl.data.tasks.register_task` adds


def task_names() -> list[str]:
    """Registered task names: the built-ins, and every name registered since (`register_task`
    adds its name here), so reading a config needs no import of the task registry."""
    return sorted(_TASK_NAMES)


def add_task_name(name: str) -> None:
    _TASK_NAMES.add(name)


_UNCHECKED = threading.local()


@contextlib.contextmanager
def tasks_unchecked():
    """Inside: `DataConfig` accepts a task name this process has not registered (a run's
    config.json read back to export or sample its policy, which needs no task;
    `jaxrl.config.readback`)."""
    _UNCHECKED.depth = getattr(_UNCHECKED, "depth", 0) + 1
    try:
        yield
    finally:
        _UNCHECKED.depth -= 1


class DataConfigError(ConfigError):
    """An invalid data/task setting; the message names the field, the value and the choices."""


def _check(owner: str, name: str, ok: bool, value: Any, need: str) -> None:
    try:
        check(owner, name, ok, value, need)
    except ConfigError as e:
        raise DataConfigError(str(e)) from None


@dataclasses.dataclass(frozen=True)
class SFTConfig:
    """Supervised warm start on task demonstrations (cross-entropy on the completion tokens).

    `steps=0` disables it. The result is cached under `cache_dir/sft-<hash>/` where the hash covers
    the model config, the task settings and these fields, so later runs skip straight to RL.
    """

    steps: int = 0
    batch_size: int = 32
    lr: float = 3e-3
    warmup_steps: int = 20
    weight_decay: float = 0.0
    max_len: int = 64  # tokens per row (prompt + demonstration + EOS); longer rows are an error
    seed: int = 0
    cache: bool = True
    cache_dir: str = "runs/cache"
    log_every: int = 50

    def __post_init__(self):
        for name in ("batch_size", "max_len", "log_every"):
            _check("data.sft", name, getattr(self, name) >= 1, getattr(self, name), ">= 1")
        _check("data.sft", "steps", self.steps >= 0, self.steps, ">= 0 (0 = no warm start)")
        _check("data.sft", "lr", self.lr > 0, self.lr, "> 0")
        _check("data.sft", "warmup_steps", self.warmup_steps >= 0, self.warmup_steps, ">= 0")
        _check("data.sft", "weight_decay", self.weight_decay >= 0, self.weight_decay, ">= 0")


@dataclasses.dataclass(frozen=True)
class DataConfig:
    """Which task, where its data lives, how prompts are ordered, evaluated and warm-started.

    Task (`task` is a registered name, see `jaxrl.data.tasks.task_names()`):
      paths / eval_paths   JSONL or Parquet files or globs (for tasks that read files).
                           Without eval_paths the last `eval_size` records are held out for eval.
      difficulty           preset level of the procedural tasks (pysynth 0-3, arith 0-3);
                           pysynth_* / arith_* fields, when set, override single knobs of it.
      train_size           size of one epoch of a procedural task (records are generated on read).
      prompt_format        "plain" text (char tokenizer), "chat" (HF chat template) or "auto"
                           (chat when the tokenizer has a template).
    Order: seeded shuffle per epoch, `epochs` passes (0 = forever), sharded by process.
    Groups: each step takes `prompts_per_step` prompts; the generator samples `group_size` each.
    Dynamic sampling: see `jaxrl.data.solve_rate`.
    Evaluation: before RL, every `eval_every` steps (0 = only at the end) and at the end, on
      `eval_size` held-out prompts, `pass_k` samples each at `eval_temperature` -> eval/pass@1
      and eval/pass@{pass_k}; `eval=False` turns all of it off.
    """

    task: str = "pysynth"
    paths: tuple[str, ...] = ()
    eval_paths: tuple[str, ...] = ()
    seed: int = 0
    epochs: int = 1
    shuffle: bool = True
    prompts_per_step: int = 8
    group_size: int = 8
    skip_bad_records: bool = False
    prompt_format: PromptFormat = "auto"
    system_prompt: str = ""
    # task "records": any JSONL / Parquet files (paths) or a Hugging Face `datasets` dataset
    # (hf_dataset: a directory saved with save_to_disk, or a Hub id; hf_split), mapped by field
    # names; the prompt is `prompt_template` formatted with the record's fields, else its
    # `prompt_field`; `reward`: comma-separated registered rewards, weight 1 each
    hf_dataset: str = ""
    hf_split: str = "train"
    prompt_field: str = "prompt"
    answer_field: str = "answer"
    tests_field: str = "tests"
    prompt_template: str = ""
    reward: str = "math_answer"
    max_new_tokens: int = 24
    # procedural tasks
    difficulty: int = 1
    train_size: int = 200_000
    pysynth_depth: int | None = None
    pysynth_const_max: int | None = None
    pysynth_examples: int | None = None
    pysynth_hidden_tests: int = 8
    arith_digits: int | None = None
    arith_terms: int | None = None
    # evaluation
    eval: bool = True  # False: no held-out evaluation at all (not before, during or after RL)
    eval_size: int = 128
    eval_every: int = 0
    pass_k: int = 4
    eval_temperature: float = 1.0
    # dynamic sampling
    filter_zero_variance: bool = True
    skip_solved: bool = False
    skip_unsolved: bool = False
    solve_rate_min_samples: int = 16
    # warm start
    sft: SFTConfig = dataclasses.field(default_factory=SFTConfig)

    def __post_init__(self):
        names = task_names()
        if self.task not in names and not getattr(_UNCHECKED, "depth", 0):
            raise DataConfigError(f"data.task={self.task!r} is not valid; valid choices: {names}")
        if self.prompt_format not in ("auto", "plain", "chat"):
            raise DataConfigError(
                f"data.prompt_format={self.prompt_format!r} is not valid; "
                "valid choices: ['auto', 'plain', 'chat']"
            )
        for name in ("paths", "eval_paths"):
            value = getattr(self, name)
            if isinstance(value, str):
                object.__setattr__(self, name, (value,))
        for name in ("prompts_per_step", "group_size", "max_new_tokens", "train_size",
                     "eval_size", "pass_k", "pysynth_hidden_tests", "solve_rate_min_samples"):
            v = getattr(self, name)
            _check("data", name, isinstance(v, int) and v >= 1, v, "an integer >= 1")
        _check("data", "epochs", self.epochs >= 0, self.epochs, ">= 0 (0 = repeat forever)")
        _check("data", "eval_every", self.eval_every >= 0, self.eval_every, ">= 0 (0 = end only)")
        _check("data", "difficulty", 0 <= self.difficulty <= 3, self.difficulty, "in 0..3")
        _check("data", "eval_temperature", self.eval_temperature >= 0, self.eval_temperature,
               ">= 0 (0 = greedy)")
        for name, lo, hi in (("pysynth_depth", 1, 4), ("pysynth_const_max", 1, 99),
                             ("pysynth_examples", 1, 8), ("arith_digits", 1, 9),
                             ("arith_terms", 2, 5)):
            v = getattr(self, name)
            if v is not None:
                _check("data", name, lo <= v <= hi, v, f"None (from difficulty) or in {lo}..{hi}")
        if self.skip_solved or self.skip_unsolved:
            _check("data", "solve_rate_min_samples", self.solve_rate_min_samples >= 1,
                   self.solve_rate_min_samples, ">= 1")

    @property
    def rollouts_per_step(self) -> int:
        return self.prompts_per_step * self.group_size
