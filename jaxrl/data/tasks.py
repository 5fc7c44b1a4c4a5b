"""Task registry: a task names its records (train / eval split), prompt format, reward(s) and the
demonstrations the SFT warm start learns from.

    task = build_task(DataConfig(task="pysynth", difficulty=1))
    src = task.source("train")                         # grain random-access source of records
    ids = task.render(record, tokenizer, "plain")      # prompt token ids
    spec = task.reward_spec()                          # RewardSpec for jaxrl.rewards.RewardScorer
    items = task.reward_items(records, completions)    # -> scorer.score_batch(items)

Built in:
  pysynth      program synthesis from I/O examples, sandboxed reward `pysynth` (see pysynth.py)
  arith        multi-digit arithmetic (number or short word problems), reward `math_answer`
  gsm8k_jsonl  GSM8K JSONL (`question`, `answer` ending "#### N") from `paths`, reward `math_answer`

A record is a dict with at least `uid` and `prompt` (the plain-text prompt) plus the fields its
reward reads (`answer`; `inputs` / `expected`). Nothing here imports jax.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import random
import re
from collections.abc import Callable, Mapping, Sequence
from typing import TYPE_CHECKING, Any

from jaxrl.config.data import SPLITS, add_task_name
from jaxrl.data import pysynth
from jaxrl.data.records import _hf_records, field_mapper, in_memory, reward_fields
from jaxrl.data.sources import GeneratedSource, RecordError, RecordSource, load_records
from jaxrl.rewards import RewardSpec

if TYPE_CHECKING:
    from jaxrl.config import RunConfig
    from jaxrl.data.config import DataConfig



@dataclasses.dataclass(frozen=True)
class Task:
    """What a run needs from a task. Build with `build_task(cfg)`.

    Fields:
      make_source: split -> records (`len`, `[i]`); eval is disjoint from train.
      demonstration: (record, chat) -> the reference completion text (SFT target, no EOS).
      chat_prompt: record -> the user message for chat templates (plain format uses `prompt`).
      rewards / reward_options: weights and options of registered rewards (`reward_spec()`).
    """

    name: str
    make_source: Callable[[str], Sequence[dict]]
    demonstration: Callable[[Mapping[str, Any], bool], str]
    chat_prompt: Callable[[Mapping[str, Any]], str]
    rewards: Mapping[str, float]
    reward_options: Mapping[str, Mapping[str, Any]] = dataclasses.field(default_factory=dict)
    system_prompt: str = ""
    eval_size: int = 128
    env: str = ""  # a multi-turn environment (jaxrl.envs) runs its episodes; "": one completion

    def source(self, split: str) -> Sequence[dict]:
        if split not in SPLITS:
            raise ValueError(f"split {split!r} is not valid; valid choices: {list(SPLITS)}")
        return self.make_source(split)

    def eval_records(self, n: int | None = None) -> list[dict]:
        """The first `n` (default `eval_size`) held-out records, always the same ones."""
        src = self.source("eval")
        n = min(n or self.eval_size, len(src))
        return [src[i] for i in range(n)]

    def reward_spec(self, timeout_s: float = 10.0):
        return RewardSpec.from_weights(dict(self.rewards), dict(self.reward_options),
                                       timeout_s=timeout_s)

    def reward_items(self, records: Sequence[Mapping], completions: Sequence[str]) -> list[dict]:
        """Scorer items: each record's fields + its completion text (records may repeat, one per
        sample of a group)."""
        if len(records) != len(completions):
            raise ValueError(f"{len(records)} records but {len(completions)} completions")
        return [{**r, "completion": c} for r, c in zip(records, completions, strict=True)]

    def render(self, record: Mapping[str, Any], tokenizer, prompt_format: str = "auto"
               ) -> list[int]:
        """Prompt token ids: plain text or a chat template, BOS first exactly once when the
        tokenizer adds one (`encode_prompt`)."""
        if resolve_format(tokenizer, prompt_format) == "chat":
            messages = [{"role": "user", "content": self.chat_prompt(record)}]
            if self.system_prompt:
                messages.insert(0, {"role": "system", "content": self.system_prompt})
            return encode_prompt(tokenizer, messages)
        try:
            return encode_prompt(tokenizer, record["prompt"])
        except ValueError as e:  # e.g. a character the char tokenizer does not know
            raise ValueError(f"record {record.get('uid')!r}: cannot encode its prompt: {e}") from e

    def render_demonstration(self, record, tokenizer, prompt_format: str = "auto") -> list[int]:
        """Demonstration token ids followed by EOS (the SFT target)."""
        chat = resolve_format(tokenizer, prompt_format) == "chat"
        return [*tokenizer.encode(self.demonstration(record, chat)), tokenizer.eos_id]


def longest_prompt(cfg: RunConfig, task: Task, tokenizer) -> int:
    """Tokens in the longest of (up to) 64 held-out prompts. The KV cache is sized for prompts
    of 1.5x that + 8 (`generate.max_len=0`)."""
    records = task.eval_records(min(64, cfg.data.eval_size))
    return max(len(task.render(r, tokenizer, cfg.data.prompt_format)) for r in records)


def encode_prompt(tokenizer, prompt: str | list[dict]) -> list[int]:
    """The ids a model is given for `prompt`: a text, or chat messages rendered with the
    tokenizer's template (the generation prompt added). BOS comes first exactly once when the
    tokenizer adds one (`add_bos`): for text as `transformers`' `tokenizer(text)`; for chat
    also when the template does not write it (`transformers`' `apply_chat_template` leaves it
    out then, which a model trained with BOS never saw), never twice when it does."""
    if isinstance(prompt, str):
        ids = list(tokenizer.encode(prompt))
    else:
        ids = list(tokenizer.apply_chat_template(prompt, add_generation_prompt=True,
                                                 tokenize=True))
    bos = getattr(tokenizer, "bos_id", None)
    if getattr(tokenizer, "add_bos", False) and bos is not None and ids[:1] != [bos]:
        ids.insert(0, bos)
    return ids


def resolve_format(tokenizer, prompt_format: str) -> str:
    has_template = bool(getattr(tokenizer, "chat_template", None))
    if prompt_format == "auto":
        return "chat" if has_template else "plain"
    if prompt_format == "chat" and not has_template:
        raise ValueError("prompt_format='chat' needs a tokenizer with a chat template (an HF "
                         "tokenizer directory); the char tokenizer takes prompt_format='plain'")
    if prompt_format not in ("plain", "chat"):
        raise ValueError(f"prompt_format {prompt_format!r} is not valid; "
                         "valid choices: ['auto', 'plain', 'chat']")
    return prompt_format


# --- registry ----------------------------------------------------------------------------------

_TASKS: dict[str, Callable[[DataConfig], Task]] = {}


def register_task(name: str, *, overwrite: bool = False):
    """Decorator registering `builder(cfg: DataConfig) -> Task` under `name`."""

    def deco(builder):
        if name in _TASKS and not overwrite:
            raise ValueError(f"task {name!r} is already registered (pass overwrite=True)")
        _TASKS[name] = builder
        add_task_name(name)  # the config checks `data.task` against these names
        return builder

    return deco


def task_names() -> list[str]:
    return sorted(_TASKS)


def build_task(cfg: DataConfig) -> Task:
    if cfg.task not in _TASKS:
        raise ValueError(f"unknown task {cfg.task!r}; registered: {task_names()}")
    return _TASKS[cfg.task](cfg)


def _split_sizes(cfg: DataConfig, split: str) -> int:
    return cfg.train_size if split == "train" else max(cfg.eval_size, 1)


# --- pysynth -------------------------------------------------------------------------------------


def pysynth_spec(cfg: DataConfig) -> pysynth.PySynthSpec:
    return pysynth.PySynthSpec.from_level(
        cfg.difficulty, depth=cfg.pysynth_depth, const_max=cfg.pysynth_const_max,
        examples=cfg.pysynth_examples, hidden_tests=cfg.pysynth_hidden_tests,
    )


@register_task("pysynth")
def _pysynth_task(cfg: DataConfig) -> Task:
    spec = pysynth_spec(cfg)

    @functools.cache
    def make_source(split: str):
        make = functools.partial(pysynth.make_problem, spec, split, seed=cfg.seed)
        return GeneratedSource(make, _split_sizes(cfg, split), f"pysynth-{split}")

    return Task("pysynth", make_source, pysynth.demonstration, pysynth.chat_prompt,
                rewards={"pysynth": 1.0}, system_prompt=cfg.system_prompt,
                eval_size=cfg.eval_size)


# --- arith ---------------------------------------------------------------------------------------

ARITH_LEVELS = {0: (1, 2, "+"), 1: (2, 2, "+-"), 2: (2, 3, "+-*"), 3: (3, 3, "+-*")}
_NAMES = ("Ann", "Bo", "Cy", "Di", "Ed", "Flo")
_ITEMS = ("pens", "apples", "coins", "books", "cards")


@dataclasses.dataclass(frozen=True)
class ArithSpec:
    digits: int = 2
    terms: int = 2
    ops: str = "+-"
    word_frac: float = 0.3  # share of short word problems (two terms, + or -)


def make_arith(spec: ArithSpec, split: str, index: int, seed: int) -> dict:
    """Problem `index` of `split`; the split is a hash bucket of the expression text."""
    rng = random.Random(f"arith:{seed}:{split}:{index}:{spec}")
    for _ in range(10_000):
        nums = [rng.randint(0 if spec.digits == 1 else 10 ** (spec.digits - 1), 10**spec.digits - 1)
                for _ in range(spec.terms)]
        ops = [rng.choice(spec.ops) for _ in range(spec.terms - 1)]
        word = spec.terms >= 2 and rng.random() < spec.word_frac
        if word:
            nums, ops = nums[:2], [rng.choice("+-")]
        expr = "".join(f"{n}{o}" for n, o in zip(nums, ops, strict=False)) + str(nums[-1])
        if (hash_text(expr) % pysynth.EVAL_BUCKETS == 0) != (split == "eval"):
            continue
        value = eval(expr, {"__builtins__": {}})  # our own digits and + - * only
        if word:
            name, item = rng.choice(_NAMES), rng.choice(_ITEMS)
            verb = "gets" if ops[0] == "+" else "gives away"
            prompt = f"{name} has {nums[0]} {item} and {verb} {nums[1]}. How many now?\nA:"
        else:
            prompt = f"{expr}="
        return {"uid": f"arith:{split}:{index}", "prompt": prompt, "expression": expr,
                "answer": str(value)}
    raise RuntimeError(f"arith: no {split} problem found for {spec}")


def hash_text(text: str) -> int:
    return int.from_bytes(hashlib.sha256(text.encode()).digest()[:8], "big")


@register_task("arith")
def _arith_task(cfg: DataConfig) -> Task:
    digits, terms, ops = ARITH_LEVELS[cfg.difficulty]
    spec = ArithSpec(digits=cfg.arith_digits or digits, terms=cfg.arith_terms or terms, ops=ops)

    @functools.cache
    def make_source(split: str):
        make = functools.partial(make_arith, spec, split, seed=cfg.seed)
        return GeneratedSource(make, _split_sizes(cfg, split), f"arith-{split}")

    def chat(record):
        return f"{record['prompt'].removesuffix('A:').rstrip('=').strip()}\n" \
               "Give only the final answer as \\boxed{N}."

    def demo(record, is_chat):
        return f"\\boxed{{{record['answer']}}}" if is_chat else record["answer"]

    return Task("arith", make_source, demo, chat, rewards={"math_answer": 1.0},
                system_prompt=cfg.system_prompt, eval_size=cfg.eval_size)


# --- gsm8k_jsonl ---------------------------------------------------------------------------------

_FINAL_RE = re.compile(r"####\s*(.+?)\s*$", re.DOTALL)
_CALC_RE = re.compile(r"<<[^>]*>>")


def parse_gsm8k(record: dict, location: str) -> dict:
    """GSM8K `answer` ("...reasoning...\\n#### 72") -> `answer` "72", `solution` the reasoning."""
    text = str(record["answer"])
    m = _FINAL_RE.search(text)
    if not m:
        raise RecordError(f"{location}: field 'answer' has no final '#### N' line: {text[-80:]!r}")
    final = m.group(1).replace(",", "").strip()
    solution = _CALC_RE.sub("", text[: m.start()]).strip()
    return {**record, "prompt": f"Question: {record['question']}\nAnswer:",
            "answer": final, "solution": solution}


@register_task("gsm8k_jsonl")
def _gsm8k_task(cfg: DataConfig) -> Task:
    def load(paths, name):
        return load_records(paths, required_fields=("question", "answer"), transform=parse_gsm8k,
                            skip_bad_records=cfg.skip_bad_records, name=name)

    @functools.cache
    def splits() -> tuple[RecordSource, RecordSource]:
        if not cfg.paths:
            raise ValueError("task gsm8k_jsonl reads local files: set data.paths to the GSM8K "
                             "train JSONL (and data.eval_paths to the test JSONL)")
        train = load(cfg.paths, "gsm8k-train")
        if cfg.eval_paths:
            return train, load(cfg.eval_paths, "gsm8k-eval")
        return train.split_tail(cfg.eval_size)

    def make_source(split: str):
        return splits()[SPLITS.index(split)]

    def chat(record):
        return (f"{record['question']}\nSolve it step by step and put the final answer in "
                "\\boxed{}.")

    def demo(record, is_chat):
        if is_chat:
            return f"{record['solution']}\nThe answer is \\boxed{{{record['answer']}}}."
        return f"{record['solution']}\n#### {record['answer']}"

    return Task("gsm8k_jsonl", make_source, demo, chat, rewards={"math_answer": 1.0},
                system_prompt=cfg.system_prompt, eval_size=cfg.eval_size)


# --- records (any files / datasets, mapped by field names; jaxrl/data/records.py) ---------------


def records_task(cfg: DataConfig, *, train: Sequence[Mapping] | None = None,
                 eval: Sequence[Mapping] | None = None, name: str = "records",
                 rewards: Mapping[str, float] | None = None):
    """A `Task` over mapped records: from `train` / `eval` lists when given, else from the
    config's files or `datasets` dataset. Without eval records the last `eval_size` train
    records are held out. A record without a field its rewards read (`answer` for
    `math_answer`) fails when the data loads, naming the field and the fields it has."""
    weights = dict(rewards) if rewards else {n.strip(): 1.0 for n in cfg.reward.split(",")
                                             if n.strip()}

    @functools.cache
    def splits() -> tuple[RecordSource, RecordSource]:
        mapper = field_mapper(cfg, reward_fields(weights))  # rewards registered by now
        if train is not None:
            tr = in_memory(train, f"{name}-train", mapper)
            ev = in_memory(eval, f"{name}-eval", mapper) if eval else None
        elif cfg.hf_dataset:
            tr = RecordSource(_hf_records(cfg, cfg.hf_split), transform=mapper,
                              skip_bad_records=cfg.skip_bad_records, name=cfg.hf_dataset)
            ev = None
        else:
            tr = load_records(cfg.paths, transform=mapper, skip_bad_records=cfg.skip_bad_records,
                              name=f"{name}-train")
            ev = (load_records(cfg.eval_paths, transform=mapper, name=f"{name}-eval")
                  if cfg.eval_paths else None)
        return (tr, ev) if ev is not None else tr.split_tail(cfg.eval_size)

    def demonstration(record, chat: bool) -> str:
        return str(record.get("completion", record.get("answer", "")))

    return Task(name, lambda split: splits()[SPLITS.index(split)], demonstration,
                lambda r: r["prompt"], rewards=weights, system_prompt=cfg.system_prompt,
                eval_size=cfg.eval_size)


@register_task("records")
def _records_task(cfg: DataConfig) -> Task:
    return records_task(cfg)


# --- multi-turn environments' tasks (the environments: jaxrl/envs/builtin.py) ------------------

# Share of `lookup` demonstrations that answer the tool's digit, by data.difficulty: the rest
# answer another digit, so the SFT warm start teaches the format (ask, then one digit) and a
# partial habit of copying; RL has to make the copying reliable.
LOOKUP_COPY_SHARE = (0.5, 0.25, 0.1, 0.0)


def make_lookup(split: str, index: int, seed: int, copy_share: float = 0.0) -> dict:
    """A key whose digit only the tool knows; the demonstration asks the tool, then answers the
    tool's digit with probability `copy_share`, else another digit (uniform over the nine)."""
    rng = random.Random(f"lookup:{seed}:{split}:{index}")
    key, digit = rng.choice("abcdefghjkmnpqrstuvwxyz"), rng.randrange(10)
    other = (digit + 1 + rng.randrange(9)) % 10
    said = digit if rng.random() < copy_share else other
    return {"uid": f"lookup:{split}:{index}", "prompt": f"{key}=", "answer": str(digit),
            "demo": f"?{digit};{said}"}


@register_task("lookup")
def _lookup_task(cfg: DataConfig) -> Task:
    @functools.cache
    def make_source(split: str):
        make = functools.partial(make_lookup, split, seed=cfg.seed,
                                 copy_share=LOOKUP_COPY_SHARE[cfg.difficulty])
        return GeneratedSource(make, _split_sizes(cfg, split), f"lookup-{split}")

    return Task("lookup", make_source, lambda r, chat: r["demo"], lambda r: r["prompt"],
                rewards={"math_answer": 1.0}, eval_size=cfg.eval_size, env="lookup")


@register_task("python_tool")
def _python_tool_task(cfg: DataConfig) -> Task:
    arith = _arith_task(cfg)

    def chat(record):
        return (arith.chat_prompt(record) + "\nYou may run Python first: "
                "<tool_call>print(...)</tool_call>; its output comes back.")

    return dataclasses.replace(arith, name="python_tool", chat_prompt=chat, env="python_tool")


@register_task("code_feedback")
def _code_feedback_task(cfg: DataConfig) -> Task:
    """pysynth problems as episodes; the reward is the final candidate's pass rate over the hidden
    tests (`pysynth_tests`: judged, not pysynth's all-or-nothing verdict)."""
    return dataclasses.replace(_pysynth_task(cfg), name="code_feedback", env="code_feedback",
                               rewards={"pysynth_tests": 1.0})
