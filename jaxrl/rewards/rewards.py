"""Reward registry, weighted combination and fault-tolerant batch scoring.

A reward is a named function `fn(prompt, completion, **example_fields) -> float`; it takes the
fields it needs (e.g. `answer`, `tests`) by keyword and ignores the rest via `**_`. A reward may
also have a batched form `batch(items, *, pool, workers, timeout_s, **options) -> list[float |
Exception]`, which the scorer prefers (code_tests sends a whole batch to the sandbox pool in one
`run` call).

    spec = RewardSpec.from_weights({"math_answer": 1.0, "format": 0.1})
    with RewardScorer(spec, pool=pool) as scorer:
        out = scorer.score_batch([{"prompt": p, "completion": c, "answer": "1/2"}, ...])
    out.total, out.components["math_answer"], out.errors

Fault tolerance: a reward that raises, returns a non-number, crashes its worker or passes its
deadline scores 0 for that item; the failure is logged and counted (`RewardBatch.errors` /
`.timeouts` per call, `RewardScorer.metrics()` cumulative), and the run goes on. Rewards registered
with `isolated=True` (the default, and so `math_answer` and `format`) run in killable worker
processes (`jaxrl.sandbox.workers`): a hang or a memory blow-up costs a worker, never the trainer.
`isolated=False` runs in-process for cheap trusted code; it still cannot crash the run, but it
cannot be timed out either. An isolated reward may be defined anywhere (an experiment file loaded
with `--config`, `__main__`, inside `config()`): the workers get it by reference when they can
import its module, else by value (cloudpickle).
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import logging
import math
import re
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import cloudpickle

from jaxrl.rewards.code import tests as _code
from jaxrl.rewards.math import answer as _math
from jaxrl.sandbox.workers import KillableWorkers, RewardTimeout, WorkerError

log = logging.getLogger(__name__)

_LOG_PER_BATCH = 3  # failures logged one by one per term and batch; the rest are summarised
RewardFn = Callable[..., float]
BatchFn = Callable[..., list]


@dataclasses.dataclass(frozen=True)
class Reward:
    """A registry entry. `batch`, if set, scores a list of items (dicts) at once."""

    name: str
    fn: RewardFn
    batch: BatchFn | None = None
    needs_pool: bool = False
    isolated: bool = True
    check_options: Callable[..., None] | None = None  # raises ValueError on a bad option value
    fields: tuple[str, ...] = ()  # item fields every item must have (checked when data loads)


_REGISTRY: dict[str, Reward] = {}


def register_reward(
    name: str,
    *,
    batch: BatchFn | None = None,
    needs_pool: bool = False,
    isolated: bool = True,
    overwrite: bool = False,
    check_options: Callable[..., None] | None = None,
    fields: Sequence[str] = (),
) -> Callable[[RewardFn], RewardFn]:
    """Decorator registering `fn(prompt, completion, **fields) -> float` under `name`.

    `check_options(**options)`, if given, validates a `RewardTerm`'s options when the spec is made.
    `fields`: the item fields the reward cannot score without (e.g. `answer`); a task whose
    records lack one fails when its data loads (the `records` task: a `RecordError` naming the
    field and the fields present) instead of scoring 0 on every item.
    """

    def deco(fn: RewardFn) -> RewardFn:
        if name in _REGISTRY and not overwrite:
            raise ValueError(f"reward {name!r} is already registered (pass overwrite=True)")
        if isolated and batch is None:
            try:  # what KillableWorkers.map sends: by reference, or by value when not importable
                cloudpickle.dumps(fn)
            except Exception as e:  # noqa: BLE001 - any pickling failure, named below
                raise ValueError(
                    f"reward {name!r} runs in worker processes (isolated=True) so it must be "
                    f"picklable, and {getattr(fn, '__qualname__', fn)!r} is not "
                    f"({type(e).__name__}: {str(e)[:200]}); register with isolated=False "
                    "to run it in-process") from None
        _REGISTRY[name] = Reward(name, fn, batch, needs_pool, isolated, check_options,
                                 tuple(fields))
        return fn

    return deco


def reward_names() -> list[str]:
    return sorted(_REGISTRY)


def get_reward(name: str) -> Reward:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(f"unknown reward {name!r}; registered: {reward_names()}") from None


@dataclasses.dataclass(frozen=True)
class RewardTerm:
    """One weighted component. `options` are passed to the reward as keyword arguments (they win
    over example fields of the same name)."""

    name: str
    weight: float = 1.0
    options: Mapping[str, Any] = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        reward = get_reward(self.name)  # unknown name -> error listing valid ones
        if reward.check_options is not None:
            reward.check_options(**self.options)  # bad value -> error naming the valid ones
        if not math.isfinite(self.weight):
            raise ValueError(f"reward {self.name!r}: weight must be finite, got {self.weight!r}")


@dataclasses.dataclass(frozen=True)
class RewardSpec:
    """Weighted sum of registered rewards. `timeout_s` is each item's deadline in a worker."""

    terms: tuple[RewardTerm, ...]
    timeout_s: float = 10.0

    def __post_init__(self):
        if not self.terms:
            raise ValueError(f"RewardSpec needs at least one term; registered: {reward_names()}")
        names = [t.name for t in self.terms]
        if len(set(names)) != len(names):
            raise ValueError(f"reward names must be unique in a spec, got {names}")
        if not self.timeout_s > 0:
            raise ValueError(f"timeout_s must be > 0, got {self.timeout_s!r}")

    @classmethod
    def from_weights(
        cls,
        weights: Mapping[str, float],
        options: Mapping[str, Mapping[str, Any]] | None = None,
        **kw,
    ) -> RewardSpec:
        options = dict(options or {})
        extra = sorted(set(options) - set(weights))
        if extra:
            raise ValueError(
                f"options given for rewards not in weights: {extra}; weights: {sorted(weights)}"
            )
        terms = tuple(RewardTerm(n, float(w), dict(options.get(n, {}))) for n, w in weights.items())
        return cls(terms, **kw)

    @property
    def needs_pool(self) -> bool:
        return any(get_reward(t.name).needs_pool for t in self.terms)


@dataclasses.dataclass
class RewardBatch:
    """Scores of one batch. `components` are unweighted, per reward name, aligned with `total`."""

    total: list[float]
    components: dict[str, list[float]]
    errors: dict[str, int]
    timeouts: dict[str, int]
    # per reward name: its first failure in this batch as "Type: message" (absent: none failed)
    first_errors: dict[str, str] = dataclasses.field(default_factory=dict)

    def metrics(self, prefix: str = "reward") -> dict[str, float]:
        n = max(1, len(self.total))
        m = {f"{prefix}/mean": sum(self.total) / n}
        for name, vals in self.components.items():
            m[f"{prefix}/{name}/mean"] = sum(vals) / n
            m[f"{prefix}/{name}/errors"] = float(self.errors.get(name, 0))
            m[f"{prefix}/{name}/timeouts"] = float(self.timeouts.get(name, 0))
        return m


def describe_error(err: BaseException) -> str:
    """`Type: message` of a reward's failure (300 characters at most). An exception raised in a
    reward worker arrives as a `WorkerError` whose message is already the worker's `Type:
    message`."""
    if type(err) is WorkerError:
        return f"{err} (in a reward worker)"[:300]
    return f"{type(err).__name__}: {err}"[:300]


def _call_item(fn: RewardFn, options: Mapping[str, Any], item: Mapping[str, Any]) -> float:
    fields = {k: v for k, v in item.items() if k not in ("prompt", "completion")}
    fields.update(options)
    return fn(item.get("prompt", ""), item.get("completion", ""), **fields)


def _as_score(value: Any) -> float:
    if isinstance(value, bool) or isinstance(value, int | float):
        v = float(value)
        if math.isfinite(v):
            return v
    raise TypeError(f"reward must return a finite number, got {value!r:.100}")


class RewardScorer:
    """Scores batches with a `RewardSpec`; owns killable workers, borrows the sandbox pool.

    Args:
      spec: which rewards, weights and options.
      pool: a sandbox pool (`LocalSandboxPool`, `RaySandboxPool`) for rewards that run code.
      workers: `KillableWorkers` to use; by default one is made with `num_workers` processes and
        closed by `close()`.
    """

    def __init__(
        self,
        spec: RewardSpec,
        *,
        pool=None,
        workers: KillableWorkers | None = None,
        num_workers: int = 2,
    ):
        if spec.needs_pool and pool is None:
            needing = [t.name for t in spec.terms if get_reward(t.name).needs_pool]
            raise ValueError(
                f"rewards {needing} need a sandbox pool: pass pool=LocalSandboxPool(...)"
            )
        self.spec = spec
        self.pool = pool
        self._own_workers = workers is None
        self.workers = workers or KillableWorkers(num_workers, preload=MATH_PRELOAD)
        self._lock = threading.Lock()
        self.error_counts = {t.name: 0 for t in spec.terms}
        self.timeout_counts = {t.name: 0 for t in spec.terms}
        self.items_scored = 0
        # Terms run concurrently, each batch's on threads of its own (the sandbox pool and the
        # reward workers overlap). Daemon threads: an in-process reward that never returns
        # holds its thread, which `close` abandons after a bound instead of waiting forever.
        self._threads: list[threading.Thread] = []

    def __enter__(self) -> RewardScorer:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, timeout_s: float = 5.0) -> None:
        """Wait up to `timeout_s` for terms still scoring, then abandon (and report) the threads
        of rewards that do not return: shutdown never hangs on a reward."""
        deadline = time.monotonic() + timeout_s
        with self._lock:
            threads, self._threads = self._threads, []
        for thread in threads:
            thread.join(max(0.0, deadline - time.monotonic()))
        hung = [t for t in threads if t.is_alive()]
        if hung:
            log.warning(
                "%d reward thread(s) still running %.0fs after shutdown (a reward that does not "
                "return; rewards.timeout_s bounds only isolated rewards): abandoned",
                len(hung),
                timeout_s,
            )
        if self._own_workers:
            self.workers.close()

    def _submit(self, term: RewardTerm, items: Sequence[Mapping[str, Any]]):
        future: concurrent.futures.Future = concurrent.futures.Future()

        def body() -> None:
            if not future.set_running_or_notify_cancel():
                return
            try:
                future.set_result(self._run_term(term, items))
            except BaseException as e:  # noqa: BLE001 - SystemExit & co.: the caller sees it
                future.set_exception(e)

        thread = threading.Thread(target=body, name=f"reward-term-{term.name}", daemon=True)
        with self._lock:
            self._threads = [t for t in self._threads if t.is_alive()] + [thread]
        thread.start()
        return future

    def score(self, prompt: str, completion: str, **fields) -> RewardBatch:
        """One item; see `score_batch`."""
        return self.score_batch([{"prompt": prompt, "completion": completion, **fields}])

    def score_batch(self, items: Sequence[Mapping[str, Any]]) -> RewardBatch:
        """Scores every item with every term; never raises for a failing reward."""
        components: dict[str, list[float]] = {}
        errors: dict[str, int] = {}
        timeouts: dict[str, int] = {}
        first_errors: dict[str, str] = {}
        total = [0.0] * len(items)
        futures = [self._submit(t, items) for t in self.spec.terms]
        for term, future in zip(self.spec.terms, futures, strict=True):
            raw = future.result()
            vals, n_err, n_to = [], 0, 0
            for k, v in enumerate(raw):
                if not isinstance(v, BaseException):
                    try:
                        vals.append(_as_score(v))
                        continue
                    except TypeError as e:
                        v = e
                # A failing reward scores 0 and is counted (timeouts apart from other errors).
                if isinstance(v, RewardTimeout):
                    n_to += 1
                else:
                    n_err += 1
                first_errors.setdefault(term.name, describe_error(v))
                self._log(term.name, k, v, n_err + n_to)
                vals.append(0.0)
            if n_err + n_to > _LOG_PER_BATCH:
                log.warning(
                    "reward %r: %d errors and %d timeouts in a batch of %d (scored 0)",
                    term.name,
                    n_err,
                    n_to,
                    len(items),
                )
            components[term.name] = vals
            errors[term.name], timeouts[term.name] = n_err, n_to
            total = [t + term.weight * v for t, v in zip(total, vals, strict=True)]
        with self._lock:
            self.items_scored += len(items)
            for name in errors:
                self.error_counts[name] += errors[name]
                self.timeout_counts[name] += timeouts[name]
        return RewardBatch(total, components, errors, timeouts, first_errors)

    def _run_term(self, term: RewardTerm, items: Sequence[Mapping[str, Any]]) -> list[Any]:
        reward = get_reward(term.name)
        try:
            if reward.batch is not None:
                out = reward.batch(
                    items,
                    pool=self.pool,
                    workers=self.workers,
                    timeout_s=self.spec.timeout_s,
                    **term.options,
                )
                if len(out) != len(items):
                    raise RuntimeError(f"batch returned {len(out)} scores for {len(items)} items")
                return list(out)
            if reward.isolated:
                call = functools.partial(_call_item, reward.fn, dict(term.options))
                return self.workers.map(
                    call, [(dict(it),) for it in items], timeout_s=self.spec.timeout_s
                )
            out = []
            for it in items:
                try:
                    out.append(_call_item(reward.fn, term.options, it))
                except Exception as e:  # noqa: BLE001
                    out.append(e)
            return out
        except Exception as e:  # noqa: BLE001 - the whole term failed: every item scores 0
            return [e] * len(items)

    def _log(self, name: str, index: int, err: BaseException, nth_in_batch: int) -> None:
        if nth_in_batch <= _LOG_PER_BATCH:  # the rest of the batch goes into one summary line
            log.warning("reward %r failed on item %d (scored 0): %s", name, index,
                        describe_error(err))

    def metrics(self) -> dict[str, float]:
        """Cumulative counters since construction, for the metrics stream."""
        with self._lock:
            m = {"reward/items_scored": float(self.items_scored)}
            for name in self.error_counts:
                m[f"reward/{name}/errors_total"] = float(self.error_counts[name])
                m[f"reward/{name}/timeouts_total"] = float(self.timeout_counts[name])
            m["reward/worker_timeouts_total"] = float(self.workers.timeouts)
            m["reward/worker_crashes_total"] = float(self.workers.crashes)
        return m


# --- built-in rewards ----------------------------------------------------------------------------


def _code_tests_batch(items, *, pool, workers=None, timeout_s=None, **options):
    return _code.code_tests_batch(items, pool=pool, **options)


@register_reward("code_tests", batch=_code_tests_batch, needs_pool=True, isolated=False)
def code_tests(prompt: str, completion: str, *, tests=None, pool=None, **fields) -> float:
    """Fraction of the tests the completion's code passes in the sandbox (mode="all": 0 or 1).

    Tests: `tests`, or a dataset's own fields (HumanEval `test` + `entry_point` with `prompt`,
    MBPP `test_list`, ...; see `code/formats.py`). Options: mode ("fraction" | "all"),
    test_timeout_s (per case), memory_mb, max_job_timeout_s (per completion), items_per_job.
    See `code/tests.py`.
    """
    option_names = ("mode", "test_timeout_s", "memory_mb", "max_job_timeout_s", "items_per_job")
    options = {k: fields.pop(k) for k in option_names if k in fields}
    item = {**fields, "prompt": prompt, "completion": completion}
    if tests is not None:
        item["tests"] = tests
    (score,) = _code.code_tests_batch([item], pool=pool, **options)
    if isinstance(score, Exception):
        raise score
    return score


def _math_item(options: Mapping[str, Any], item: Mapping[str, Any]) -> float:
    if "answer" not in item:
        raise ValueError(f"math_answer needs an 'answer' field; item has {sorted(item)}")
    return _math.math_score(str(item.get("completion", "")), str(item["answer"]), **options)


def _math_check_options(**options) -> None:
    unknown = sorted(set(options) - set(MATH_OPTIONS))
    if unknown:
        raise ValueError(f"math_answer: unknown options {unknown}; valid: {list(MATH_OPTIONS)}")
    _math.check_options(**options)


MATH_OPTIONS = ("backend", "units", "percent", "rel_tol", "max_answer_chars")
# Imported by each worker before it takes work (a missing optional one is skipped).
MATH_PRELOAD = ("sympy", "math_verify")


def _math_batch(items, *, workers, timeout_s, pool=None, **options):
    _math_check_options(**options)
    slim = [
        (
            dict(
                completion=it.get("completion", ""),
                **({"answer": it["answer"]} if "answer" in it else {}),
            ),
        )
        for it in items
    ]
    return workers.map(functools.partial(_math_item, options), slim, timeout_s=timeout_s)


_default_workers: KillableWorkers | None = None
_default_lock = threading.Lock()


def default_workers() -> KillableWorkers:
    """A process-wide `KillableWorkers` for the per-item convenience functions (lazily made)."""
    global _default_workers
    with _default_lock:
        if _default_workers is None:
            _default_workers = KillableWorkers(2, preload=MATH_PRELOAD)
        return _default_workers


@register_reward("math_answer", batch=_math_batch, check_options=_math_check_options,
                 fields=("answer",))
def math_answer(
    prompt: str,
    completion: str,
    *,
    answer: str,
    timeout_s: float = 10.0,
    workers: KillableWorkers | None = None,
    **fields,
) -> float:
    """1.0 if the final answer (last \\boxed{}, else `#### N`, else last number) equals `answer`.

    Options (see `math/answer.py`): backend ("auto" | "sympy" | "math_verify"), units ("strip" |
    "keep"), percent ("strip" | "value" | "keep"), rel_tol (decimals), max_answer_chars. Runs in a
    killable worker (deadline `timeout_s`); a timeout raises `RewardTimeout`.
    """
    del prompt
    options = {k: v for k, v in fields.items() if k in MATH_OPTIONS}
    (v,) = _math_batch(
        [{"completion": completion, "answer": answer}],
        workers=workers or default_workers(),
        timeout_s=timeout_s,
        **options,
    )
    if isinstance(v, BaseException):
        raise v
    return v


DEFAULT_FORMAT_PATTERN = r"^\s*<think>.*?</think>\s*<answer>.*?</answer>\s*$"
_FORMAT_MODES = ("search", "match", "fullmatch")


@register_reward("format")
def format_reward(
    prompt: str,
    completion: str,
    *,
    pattern: str = DEFAULT_FORMAT_PATTERN,
    mode: str = "search",
    flags: int = re.DOTALL,
    **_,
) -> float:
    """1.0 if `completion` matches the regex `pattern` (re.search / match / fullmatch), else 0.0.

    Runs in a killable worker by default, so a catastrophically backtracking pattern times out.
    """
    del prompt
    if mode not in _FORMAT_MODES:
        raise ValueError(f"format mode must be one of {_FORMAT_MODES}, got {mode!r}")
    return float(getattr(re, mode)(pattern, completion, flags) is not None)
