"""Reward functions: hand-checked values, weighting, and failure -> 0 + counted error.

code_tests runs on the real sandbox pool (`LocalSandboxPool`, tier "auto"; the tier is printed
and in the test id).
"""

from __future__ import annotations

import threading
import time

import pytest

from jaxrl.rewards.code import tests as ct
from jaxrl.rewards.math import answer as ma
from jaxrl.rewards.rewards import (
    RewardScorer,
    RewardSpec,
    RewardTerm,
    get_reward,
    register_reward,
    reward_names,
)
from jaxrl.sandbox.workers import KillableWorkers

# --- fixtures ------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def workers():
    with KillableWorkers(2, preload=("sympy",)) as w:
        yield w


@pytest.fixture(scope="module")
def pool():
    from jaxrl.rewards import LocalSandboxPool

    with LocalSandboxPool(num_workers=2) as p:
        print(f"sandbox tier: {getattr(p, 'tier', '?')}")
        yield p


# --- math ----------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "pred, gold, same",
    [
        ("1/2", "0.5", True),
        ("\\frac{1}{2}", "0.5", True),
        ("\\dfrac12", "1/2", True),
        ("3", "3.0", True),
        ("1,000", "1000", True),
        ("-3", "-3", True),
        ("\\frac{3}{4}", "0.75", True),
        ("50\\%", "50", True),
        ("x = 5", "5", True),
        ("5 \\text{ cm}", "5", True),
        ("\\sqrt{2}/2", "\\frac{\\sqrt{2}}{2}", True),
        ("2x+1", "1+2x", True),
        ("x^2", "x**2", True),
        ("2\\pi", "\\pi*2", True),
        ("10^{3}", "1000", True),
        ("(1, 2)", "(1,2)", True),
        ("1.414214", "\\sqrt{2}", True),  # floats: relative tolerance 1e-6
        ("2", "3", False),
        ("0.333", "1/3", False),
        ("-1/2", "1/2", False),
        ("x+1", "x-1", False),
        ("(1, 2)", "(2, 1)", False),
        ("", "0", False),
        ("__import__('os').system('true')", "0", False),  # outside the whitelist: never parsed
        ("(1).real", "1", False),
    ],
)
def test_answers_equivalent_hand_checked(pred, gold, same):
    assert ma.answers_equivalent(pred, gold) is same


@pytest.mark.parametrize(
    "text, answer",
    [
        ("so the answer is \\boxed{\\frac{1}{2}}.", "\\frac{1}{2}"),
        ("first \\boxed{1} then \\boxed{2}", "2"),
        ("nested \\boxed{\\frac{\\sqrt{3}}{2}} end", "\\frac{\\sqrt{3}}{2}"),
        ("\\boxed 5", "5"),
        ("we get 12 apples and 3/4 cups", "3/4"),
        ("total: 1,234.", "1,234"),
        ("no digits here", None),
    ],
)
def test_extract_answer(text, answer):
    assert ma.extract_answer(text) == answer


def test_answer_length_cap():
    assert ma.answers_equivalent("1" * 300, "1" * 300, max_answer_chars=256) is False
    assert ma.math_score("\\boxed{" + "1+" * 200 + "1}", "201") == 0.0


def test_math_answer_scores_in_workers(workers):
    spec = RewardSpec.from_weights({"math_answer": 1.0})
    items = [
        {"prompt": "p", "completion": "half is \\boxed{0.5}", "answer": "1/2"},
        {"prompt": "p", "completion": "\\boxed{3}", "answer": "3"},
        {"prompt": "p", "completion": "I think 7", "answer": "7"},
        {"prompt": "p", "completion": "\\boxed{4}", "answer": "3"},
        {"prompt": "p", "completion": "no answer", "answer": "3"},
    ]
    with RewardScorer(spec, workers=workers) as scorer:
        out = scorer.score_batch(items)
    assert out.components["math_answer"] == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert out.total == [1.0, 1.0, 1.0, 0.0, 0.0]
    assert out.errors == {"math_answer": 0} and out.timeouts == {"math_answer": 0}


def test_math_answer_per_item(workers):
    fn = get_reward("math_answer").fn
    assert fn("p", "\\boxed{\\frac{2}{4}}", answer="0.5", workers=workers) == 1.0
    assert fn("p", "\\boxed{2}", answer="0.5", workers=workers) == 0.0


def test_math_timeout_scores_zero_and_counts(workers):
    spec = RewardSpec.from_weights({"math_answer": 1.0}, timeout_s=1.0)
    items = [
        {"completion": "\\boxed{\\sqrt{10^{4000}+1}}", "answer": "1"},  # ~12 s of sympy factoring
        {"completion": "\\boxed{2}", "answer": "2"},
    ]
    with RewardScorer(spec, workers=workers) as scorer:
        t0 = time.monotonic()
        out = scorer.score_batch(items)
        assert time.monotonic() - t0 < 10
        assert out.components["math_answer"] == [0.0, 1.0]
        assert out.timeouts == {"math_answer": 1}
        assert scorer.metrics()["reward/math_answer/timeouts_total"] == 1.0
    # The killed worker was replaced: the pool still answers.
    assert workers.map(ma.math_score, [("\\boxed{1/2}", "0.5")], timeout_s=5) == [1.0]


def test_math_verify_backend_is_optional(workers):
    try:
        import math_verify  # noqa: F401
    except ImportError:
        spec = RewardSpec((RewardTerm("math_answer", options={"backend": "math_verify"}),))
        with RewardScorer(spec, workers=workers) as scorer:
            out = scorer.score_batch([{"completion": "\\boxed{1}", "answer": "1"}])
        assert out.total == [0.0] and out.errors == {"math_answer": 1}
    else:
        assert ma.math_score("\\boxed{\\frac{1}{2}}", "0.5", backend="math_verify") == 1.0


# --- format ------------------------------------------------------------------------------------


def test_format_regex(workers):
    spec = RewardSpec.from_weights({"format": 1.0})
    items = [
        {"completion": "<think>hmm</think> <answer>4</answer>"},
        {"completion": "<think>hmm</think> 4"},
        {"completion": "<answer>4</answer><think>x</think>"},
    ]
    with RewardScorer(spec, workers=workers) as scorer:
        assert scorer.score_batch(items).total == [1.0, 0.0, 0.0]
    custom = RewardSpec((RewardTerm("format", options={"pattern": r"\\boxed\{.+\}"}),))
    with RewardScorer(custom, workers=workers) as scorer:
        out = scorer.score_batch([{"completion": "x \\boxed{1}"}, {"completion": "x"}])
        assert out.total == [1.0, 0.0]


def test_format_catastrophic_regex_times_out(workers):
    spec = RewardSpec((RewardTerm("format", options={"pattern": r"^(a+)+$"}),), timeout_s=1.0)
    with RewardScorer(spec, workers=workers) as scorer:
        out = scorer.score_batch([{"completion": "a" * 40 + "b"}, {"completion": "aaa"}])
    assert out.total == [0.0, 1.0] and out.timeouts == {"format": 1}


# --- registry, combination, failures -----------------------------------------------------------


def test_unknown_reward_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown reward 'nope'.*code_tests.*format.*math_answer"):
        RewardSpec.from_weights({"nope": 1.0})
    with pytest.raises(ValueError, match="already registered"):
        register_reward("format")(lambda p, c, **_: 1.0)


def _length_bonus(prompt, completion, **_):
    return min(1.0, len(completion) / 10)


def _always_raises(prompt, completion, **_):
    raise RuntimeError("reward bug")


def _returns_nan(prompt, completion, **_):
    return float("nan")


register_reward("test_length", isolated=False, overwrite=True)(_length_bonus)
register_reward("test_raises", isolated=False, overwrite=True)(_always_raises)
register_reward("test_nan", isolated=False, overwrite=True)(_returns_nan)


def test_unpicklable_reward_cannot_be_isolated():
    lock = threading.Lock()  # a closure over a lock cannot reach a worker process
    with pytest.raises(ValueError, match=r"'test_lock'.*must be picklable.*TypeError.*lock"):
        register_reward("test_lock", overwrite=True)(lambda p, c, **_: float(lock.locked()))
    register_reward("test_lock", overwrite=True, isolated=False)(lambda p, c, **_: 1.0)


def test_weighted_combination_with_components(workers):
    assert {"test_length", "test_raises"} <= set(reward_names())
    spec = RewardSpec.from_weights({"math_answer": 2.0, "format": 0.5, "test_length": -1.0})
    items = [
        {"completion": "<think>a</think><answer>\\boxed{2}</answer>", "answer": "2"},  # 41 chars
        {"completion": "\\boxed{3}", "answer": "2"},  # 9 chars
    ]
    with RewardScorer(spec, workers=workers) as scorer:
        out = scorer.score_batch(items)
    assert out.components == {
        "math_answer": [1.0, 0.0],
        "format": [1.0, 0.0],
        "test_length": [1.0, 0.9],
    }
    assert out.total == pytest.approx([2.0 + 0.5 - 1.0, -0.9])
    m = out.metrics()
    assert m["reward/math_answer/mean"] == 0.5 and m["reward/mean"] == pytest.approx(0.3)


def test_raising_reward_scores_zero_and_is_counted(workers, caplog):
    spec = RewardSpec.from_weights({"test_raises": 1.0, "test_nan": 1.0, "math_answer": 1.0})
    items = [{"completion": "\\boxed{1}", "answer": "1"}, {"completion": "\\boxed{1}"}]  # no answer
    with RewardScorer(spec, workers=workers) as scorer:
        out = scorer.score_batch(items)
        out2 = scorer.score_batch(items[:1])
        m = scorer.metrics()
    assert out.components["test_raises"] == [0.0, 0.0] and out.errors["test_raises"] == 2
    assert out.components["test_nan"] == [0.0, 0.0] and out.errors["test_nan"] == 2
    assert out.components["math_answer"] == [1.0, 0.0] and out.errors["math_answer"] == 1
    assert out.total == [1.0, 0.0] and out2.total == [1.0]
    assert m["reward/test_raises/errors_total"] == 3 and m["reward/math_answer/errors_total"] == 1
    assert "reward bug" in caplog.text


def test_spec_validation():
    with pytest.raises(ValueError, match="finite"):
        RewardTerm("format", weight=float("inf"))
    with pytest.raises(ValueError, match="unique"):
        RewardSpec((RewardTerm("format"), RewardTerm("format")))
    with pytest.raises(ValueError, match="not in weights"):
        RewardSpec.from_weights({"format": 1.0}, options={"math_answer": {}})
    with pytest.raises(ValueError, match="need a sandbox pool"):
        RewardScorer(RewardSpec.from_weights({"code_tests": 1.0}))


def test_rewards_reexports_the_sandbox_runtime():
    """`from jaxrl.rewards import X` works for every name of its `__all__`; the pools, jobs and
    workers are `jaxrl.sandbox`'s own (RaySandboxPool: tests/sandbox/test_ray_pool.py)."""
    import jaxrl.rewards
    import jaxrl.sandbox

    for name in set(jaxrl.rewards.__all__) - {"RaySandboxPool"}:
        home = jaxrl.sandbox if name in jaxrl.sandbox.__all__ else jaxrl.rewards.rewards
        assert getattr(jaxrl.rewards, name) is getattr(home, name), name


# --- code_tests: parsing and comparison (no sandbox) -------------------------------------------


def test_build_spec_formats():
    from jaxrl.rewards.code.formats import build_spec

    spec = build_spec({"tests": ["assert add(1, 2) == 3", "assert is_ok(1)\nassert not is_ok(0)"]},
                      "")
    assert [c["src"] for c in spec["cases"]] == [
        "assert add(1, 2) == 3", "assert is_ok(1)", "assert not is_ok(0)"]
    apps = build_spec({"tests": '{"inputs": ["1 2"], "outputs": ["3"]}'}, "")
    assert apps["cases"] == [{"k": "stdio", "stdin": "1 2", "expected": "3"}]
    fn = build_spec({"tests": {"inputs": [[1, 2]], "outputs": [3], "fn_name": "add"}}, "")
    assert fn["cases"][0]["k"] == "call" and fn["cases"][0]["args"] == ["l", [1, 2]]
    # Any assert form is accepted now (it runs in the clean judge process).
    build_spec({"tests": ["assert abs(f(1) - 3.0) < 1e-6"]}, "")
    with pytest.raises(ValueError, match="does not parse"):
        build_spec({"tests": ["assert f(1) =="]}, "")
    with pytest.raises(ValueError, match="unrecognised test case"):
        build_spec({"tests": [{"foo": 1}]}, "")


def test_legacy_harness_keeps_expected_values_out():  # the single-process harness pysynth uses
    cases = [ct.TestCase("expr", 987654321, expr="add(1, 2)"),
             ct.TestCase("call", "SECRET", fn="f", args=(5,))]
    src = ct.harness_source("def add(a, b): return a + b", cases, "n0nce")
    assert "987654321" not in src and "SECRET" not in src and "add(1, 2)" in src


def test_values_equal_and_forged_lines():
    assert ct.values_equal(0.1 + 0.2, 0.3) and ct.values_equal((1, 2), [1, 2])
    assert not ct.values_equal("1", 1) and not ct.values_equal([1], [1, 2])
    out = "n 0 value 3\nn 0 value 3\nn 1 value 4\nx 2 value 5\n"
    assert ct.parse_harness_output(out, "n", 3) == [None, ("value", "4"), None]


def test_extract_code():
    assert ct.extract_code("text\n```python\nx = 1\n```\nmore\n```py\ny = 2\n```") == "y = 2\n"
    assert ct.extract_code("x = 3") == "x = 3"


# --- code_tests in the sandbox pool -------------------------------------------------------------

ADD_OK = "```python\ndef add(a, b):\n    return a + b\n```"
ADD_BAD = "def add(a, b):\n    return a + b if a < 3 else 0\n"
ADD_TESTS = [
    {"fn": "add", "args": [a, b], "expected": a + b} for a, b in [(1, 2), (2, 2), (3, 4), (5, 5)]
]
SUM_STDIN = "a, b = map(int, input().split())\nprint(a + b if a < 3 else -1)\n"
STDIN_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "5 5\n", "output": "10\n"}]


def test_code_tests_fraction_and_all_or_nothing(pool, workers):
    items = [
        {"completion": ADD_OK, "tests": ADD_TESTS},
        {"completion": ADD_BAD, "tests": ADD_TESTS},
        {"completion": SUM_STDIN, "tests": STDIN_TESTS},
        {
            "completion": "def add(a, b): return a + b",
            "tests": ["assert add(1, 2) == 3", "assert add(0, 0) == 1"],
        },
        {"completion": ADD_OK},  # no tests field: error
    ]
    frac = RewardSpec.from_weights({"code_tests": 1.0})
    all_ = RewardSpec((RewardTerm("code_tests", options={"mode": "all"}),))
    with (
        RewardScorer(frac, pool=pool, workers=workers) as s1,
        RewardScorer(all_, pool=pool, workers=workers) as s2,
    ):
        out = s1.score_batch(items)
        out_all = s2.score_batch(items)
    assert out.total == [1.0, 0.5, 0.5, 0.5, 0.0]
    assert out_all.total == [1.0, 0.0, 0.0, 0.0, 0.0]
    assert out.errors == {"code_tests": 1}


def test_code_tests_per_item(pool):
    fn = get_reward("code_tests").fn
    assert fn("p", ADD_OK, tests=ADD_TESTS, pool=pool) == 1.0
    assert fn("p", ADD_BAD, tests=ADD_TESTS, pool=pool, mode="all") == 0.0


@pytest.mark.parametrize(
    "name, completion",
    [
        ("exit0", "import sys\nsys.exit(0)\ndef add(a, b): return 0"),
        ("os_exit0", "import os\nos._exit(0)"),
        ("eq_always_true", "class A:\n    __eq__ = lambda s, o: True\ndef add(a, b): return A()"),
        (
            "int_subclass_eq",
            "class I(int):\n    __eq__ = lambda s, o: True\ndef add(a, b): return I(0)",
        ),
        (
            "patched_builtins",
            "import builtins\nbuiltins.repr = lambda v: 'True'\nbuiltins.type = lambda v: int\n"
            "builtins.isinstance = lambda *a: True\ndef add(a, b): return None",
        ),
        (
            "fake_markers",
            "import os, sys\nn = sys._getframe(1).f_globals['_NONCE']\n"
            "print('PASS\\nALL TESTS PASSED\\nOK')\n"
            "for i, v in enumerate([3, 4, 7, 10]):\n"
            "    os.write(1, f'{n} {i} value {v}\\n'.encode())\n"
            "def add(a, b): return 0",  # forged right values + real wrong ones: every case void
        ),
    ],
)
def test_code_tests_reward_hacks_score_zero(pool, name, completion):
    fn = get_reward("code_tests").fn
    assert fn("p", completion, tests=ADD_TESTS, pool=pool) == 0.0, name
    hack_stdin = "import os\nos._exit(0)" if name == "os_exit0" else "print('PASS')\nexit(0)"
    assert fn("p", hack_stdin, tests=STDIN_TESTS, pool=pool) == 0.0


class _CountingPool:
    """Wraps a pool and records the size of every `run` call."""

    def __init__(self, pool):
        self.pool, self.calls = pool, []

    def run(self, jobs):
        self.calls.append(len(jobs))
        return self.pool.run(jobs)


def test_code_tests_batch_is_one_pool_call(pool, workers):
    counting = _CountingPool(pool)
    items = [
        {"completion": ADD_OK, "tests": ADD_TESTS},  # one judge job
        {"completion": SUM_STDIN, "tests": STDIN_TESTS},  # one job per stdin test
        {"completion": ADD_BAD, "tests": ADD_TESTS},
    ]
    spec = RewardSpec.from_weights({"code_tests": 1.0, "math_answer": 0.0})
    with RewardScorer(spec, pool=counting, workers=workers) as scorer:
        out = scorer.score_batch(items)
    assert counting.calls == [4]
    assert out.components["code_tests"] == [1.0, 0.5, 0.5]


def test_code_tests_timeout_scores_zero(pool):
    fn = get_reward("code_tests").fn
    loop_fn = "def add(a, b):\n    while True:\n        pass\n"
    loop_stdin = "while True:\n    pass\n"
    t0 = time.monotonic()
    assert fn("p", loop_fn, tests=ADD_TESTS, pool=pool, test_timeout_s=0.5) == 0.0
    assert fn("p", loop_stdin, tests=STDIN_TESTS, pool=pool, test_timeout_s=0.5) == 0.0
    assert time.monotonic() - t0 < 10
    # Cases that finished before the hang still count.
    partial = "def add(a, b):\n    while a > 2:\n        pass\n    return a + b\n"
    assert fn("p", partial, tests=ADD_TESTS, pool=pool, test_timeout_s=0.5) == 0.5


def test_math_auto_backend_without_math_verify(workers):
    spec = RewardSpec((RewardTerm("math_answer", options={"backend": "auto"}),))
    with RewardScorer(spec, workers=workers) as scorer:
        out = scorer.score_batch([{"completion": "\\boxed{\\frac{6}{4}}", "answer": "1.5"}])
    assert out.total == [1.0] and out.errors == {"math_answer": 0}
    with pytest.raises(ValueError, match="backend must be one of"):
        ma.math_score("1", "1", backend="wolfram")
