"""Hostile answers for the `math_answer` reward (issue 17's math findings, and more of their kind).

Each finding was reproduced on the old checker before the fix (see the commit message): an
infinity plus an imaginary part, or a bare infinity, or a power that overflows to a float infinity,
took the tolerance comparison `|a - b| <= tol * max(|a|, |b|)` to `inf <= inf`, i.e. full reward.
The rule now: infinities, NaN, complex values and overflowing powers never equal a finite gold, and
every check is bounded (sizes before evaluation; the worker's deadline and memory limit after).
"""

from __future__ import annotations

import time

import pytest

from jaxrl.rewards.math import answer as ma
from jaxrl.rewards.rewards import RewardScorer, RewardSpec
from jaxrl.sandbox.workers import KillableWorkers

FINITE_GOLDS = ["3", "2.5", "-0.5", "0", "1", "1/3", "\\frac{\\sqrt{2}}{2}", "1000000", "x+1"]


@pytest.mark.parametrize("gold", FINITE_GOLDS)
@pytest.mark.parametrize(
    "pred",
    [
        "\\infty + 0.5i",  # finding: full reward for any numeric gold
        "\\infty",  # finding: matched decimal golds
        "-\\infty",
        "\\infty + 0.5",
        "-\\infty - 2.5",
        "0.5\\infty",
        "\\infty i",
        "9.0^{9^{9}}",  # finding: overflowed to a float infinity, matched 3
        "-9.0^{9^{9}}",
        "10.0^{400}",  # past double range
        "1.0/0",
        "0/0",
        "\\infty - \\infty",
        "\\frac{1}{0}",
        "\\frac{0.0}{0.0}",
        "nan",
        "NaN",
        "zoo",
        "oo",
        "1e999",
        "3 + 0.000001i",  # complex, never a real gold
        "i^{2} + 4i",
        "\\infty^{0}",  # sympy: 1 (found after the first fix: any arithmetic on an infinity)
        "\\infty^{0} + 2",
        "\\frac{1}{\\infty}",  # sympy: 0
        "e^{-\\infty}",
        "0 \\cdot \\infty",
        "\\frac{\\infty}{\\infty}",
        "3 + 0\\infty",
    ],
)
def test_nonfinite_and_complex_never_equal_a_finite_gold(pred, gold):
    assert ma.math_score(f"so \\boxed{{{pred}}}", gold) == 0.0
    assert ma.answers_equivalent(pred, gold) is False


@pytest.mark.parametrize(
    "pred, gold, same",
    [
        ("i^2", "-1", True),  # a complex-looking expression with a real value is fine
        ("(1+i)(1-i)", "2", True),
        ("2+3i", "3i+2", True),  # complex golds compare as complex numbers
        ("2+3.0000000001i", "2+3i", True),
        ("2-3i", "2+3i", False),
        ("2", "2+3i", False),
        ("\\infty", "\\infty", True),  # an infinite gold matches the same infinity only
        ("-\\infty", "\\infty", False),
        ("\\infty", "-\\infty", False),
        ("(-\\infty, 3]", "(-\\infty,3]", True),
        ("(-\\infty, 3]", "(-\\infty, 3.001]", False),  # endpoints: no infinite tolerance
        ("[\\infty, 3]", "(-\\infty, 3]", False),
        ("(3, \\infty)", "(3, 10^{400})", False),
    ],
)
def test_infinity_and_complex_golds(pred, gold, same):
    assert ma.answers_equivalent(pred, gold) is same


@pytest.mark.parametrize(
    "pred",
    [
        "9^{9^{9^{9}}}",
        "9^{9^{9}}",
        "2^{2^{2^{2^{2}}}}",
        "10^{10^{10}}",
        "(10^{100})^{10^{100}}",
        "(-7)^{5^{20}}",
        "10^{100000}",
        "0.5^{10^{12}}",  # underflow to 0 is as wrong as overflow
        "x^{10^{10}}",
        "(x+1)^{100000}",
        "\\sqrt[10^{12}]{2}",
        "(" * 60 + "1" + ")" * 60,
        "{" * 60 + "1" + "}" * 60,
        "\\frac{" * 40 + "1}{2}" * 40,
        "1" + "+1" * 120,
        "9" * 240,
    ],
)
def test_huge_or_deep_answers_are_refused_fast(pred):
    t0 = time.monotonic()
    assert ma.math_score(f"\\boxed{{{pred}}}", "3") == 0.0
    assert ma.answers_equivalent(pred, "1") is False
    assert time.monotonic() - t0 < 2.0, pred  # refused by size, not by the worker's deadline


@pytest.mark.parametrize(
    "pred",
    [
        "1" + " cm" * 80 + " x",  # a unit-stripping regex backtracked exponentially on this
        "1" + " square cm per x" * 12 + "!",
        "1" + " " * 200 + "x",
        "\\boxed{" * 100 + "1",
    ],
)
def test_normalisation_regexes_are_not_catastrophic(pred):
    t0 = time.monotonic()
    ma.answers_equivalent(pred, "1")
    assert time.monotonic() - t0 < 2.0


def test_large_but_reasonable_numbers_still_compare():
    assert ma.answers_equivalent("2^{100}", "1267650600228229401496703205376") is True
    assert ma.answers_equivalent("10^{-3}", "0.001") is True
    assert ma.answers_equivalent("2^{100}", "1267650600228229401496703205377") is False
    assert ma.answers_equivalent("1.0 \\times 10^{300}", "10^{300}") is True


@pytest.mark.parametrize(
    "pred",
    [
        "__import__('os').system('true')",
        "(1).real",
        "().__class__",
        "lambda: 1",
        "x.__class__",
        "eval('1')",
        "Integer(3)",
        "Symbol('x')",
        "1 if 1 else 3",
        "[3][0]",
        "3;import os",
        "\\text{3}\\,\\mathrm{__import__}",
    ],
)
def test_code_like_answers_are_never_evaluated(pred, monkeypatch):
    import sympy.parsing.sympy_parser as sp

    def boom(*a, **k):
        raise AssertionError("sympy's parser must not be called")

    monkeypatch.setattr(sp, "parse_expr", boom)
    assert ma.answers_equivalent(pred, "3") is False


@pytest.mark.parametrize(
    "pred, gold",
    [
        ("1, 2, 3", "3"),  # hedging: a list of candidates is not the answer
        ("3, 3", "3"),
        ("\\{3, 4\\}", "3"),
        ("3 \\text{ or } 4", "3"),
        ("(3, 4)", "3"),
        ("\\boxed{3}", "4"),
        ("x", "3"),  # a free variable is not a number
        ("3 + 0x", "4"),
    ],
)
def test_hedged_answers_score_zero(pred, gold):
    assert ma.answers_equivalent(pred, gold) is False


def test_hedging_with_many_boxes_takes_the_last():
    assert ma.math_score("#### 72 or 73", "72") == 0.0
    assert ma.math_score("#### 72 apples or 73", "72") == 0.0
    assert ma.math_score("\\boxed{3} or maybe \\boxed{4}", "3") == 0.0
    assert ma.math_score("\\boxed{4} no wait \\boxed{3}", "3") == 1.0


def test_slow_check_is_killed_at_the_deadline_and_the_worker_replaced():
    # Within the parser's limits but costly for sympy (it looks for square factors of a 4000-digit
    # integer, ~12 s here): the worker's deadline bounds it, and the next item is scored.
    heavy = "\\sqrt{10^{4000}+1}"
    spec = RewardSpec.from_weights({"math_answer": 1.0}, timeout_s=1.0)
    items = [
        {"completion": f"\\boxed{{{heavy}}}", "answer": "3"},
        {"completion": "7", "answer": "7"},
    ]
    with KillableWorkers(1, preload=("sympy",)) as w, RewardScorer(spec, workers=w) as scorer:
        t0 = time.monotonic()
        out = scorer.score_batch(items)
        assert time.monotonic() - t0 < 15
    assert out.total == [0.0, 1.0] and out.timeouts == {"math_answer": 1}
    assert w.timeouts == 1


def test_size_limits_are_where_documented():
    from jaxrl.rewards.math import parse as ml

    assert ml.parse_answer("10^{4999}").value == 10**4999
    for big in ("10^{5001}", "2^{20000}", "x^{65}", "1001!", "\\sqrt[101]{2}"):
        with pytest.raises(ml.Unparsable):
            ml.parse_answer(big)
    with pytest.raises(ml.Unparsable, match="nested"):
        ml.parse_answer("(" * (ml.MAX_DEPTH + 1) + "1" + ")" * (ml.MAX_DEPTH + 1))
    assert ma.math_score("\\boxed{" + "1+" * 200 + "1}", "201") == 0.0  # over 256 characters
