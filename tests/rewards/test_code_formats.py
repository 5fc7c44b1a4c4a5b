"""The public code datasets' test formats through `code_tests`, on small fixtures written here in
each dataset's own field layout: reference solutions pass, wrong ones fail.

MBPP rows: `text`, `code`, `test_list` (asserts), `test_setup_code`, `test_imports`.
APPS rows: `input_output` = JSON {"inputs", "outputs", "fn_name"?}. CodeContests rows:
`public_tests` = {"input": [...], "output": [...]}. LiveCodeBench rows: `public_test_cases` = JSON
list of {"input", "output", "testtype": "stdin" | "functional"}, `metadata` = JSON {"func_name"}.
"""

from __future__ import annotations

import json

import pytest

from jaxrl.rewards.code.formats import build_spec
from jaxrl.rewards.code.tests import code_tests_batch


@pytest.fixture(scope="module")
def pool():
    from jaxrl.rewards import LocalSandboxPool

    with LocalSandboxPool(num_workers=2) as p:
        yield p


MBPP = [
    {  # plain asserts; the solution imports nothing the test needs
        "task_id": 901, "text": "Write a function to find the area of a circle.",
        "code": "def circle_area(r):\n  return 3.141592653589793 * r * r",
        "test_list": ["assert math.isclose(circle_area(10), 314.1592653589793)",
                      "assert math.isclose(circle_area(1), math.pi)"],
        "test_setup_code": "", "test_imports": [],
        "wrong": "def circle_area(r):\n  return 3.14 * r * r",
    },
    {  # test_imports + test_setup_code define what the asserts use
        "task_id": 902, "text": "Count the items of a Counter-like mapping with value > k.",
        "code": "def count_over(d, k):\n  return sum(1 for v in d.values() if v > k)",
        "test_list": ["assert count_over(C, 1) == 2", "assert count_over(C, 5) == 0",
                      "assert count_over(Counter('aab'), 0) == 2"],
        "test_setup_code": "C = Counter('aabbbc')",
        "test_imports": ["from collections import Counter"],
        "wrong": "def count_over(d, k):\n  return len(d)",
    },
    {  # Python semantics: a tuple is not a list
        "task_id": 903, "text": "Return the min and max of a list as a tuple.",
        "code": "def min_max(xs):\n  return (min(xs), max(xs))",
        "test_list": ["assert min_max([3, 1, 2]) == (1, 3)", "assert min_max([5]) == (5, 5)"],
        "test_setup_code": "", "test_imports": [],
        "wrong": "def min_max(xs):\n  return [min(xs), max(xs)]",
    },
]

SUM_OK = "a, b = map(int, input().split())\nprint(a + b)\n"
SUM_BAD = "a, b = map(int, input().split())\nprint(a + b if a < 5 else a * b)\n"
SORT_OK = "n = int(input())\nprint(*sorted(map(int, input().split())))\n"
SORT_BAD = "n = int(input())\nprint(*map(int, input().split()))\n"
STDIO = [  # (row, field holding the tests, reference, wrong)
    ({"input_output": json.dumps({"inputs": ["1 2\n", "7 8\n"], "outputs": ["3\n", "15\n"]})},
     "input_output", SUM_OK, SUM_BAD),
    ({"public_tests": {"input": ["3\n3 1 2\n", "1\n5\n"], "output": ["1 2 3\n", "5\n"]}},
     "public_tests", SORT_OK, SORT_BAD),
    ({"public_test_cases": json.dumps([
        {"input": "2 3\n", "output": "5", "testtype": "stdin"},
        {"input": "10 20\n", "output": "30   \n\n", "testtype": "stdin"}])},
     "public_test_cases", SUM_OK, SUM_BAD),
]


def _mbpp_items(rows, key):
    return [{"completion": r[key], **{k: r[k] for k in ("test_list", "test_setup_code",
                                                          "test_imports")}} for r in rows]


def test_mbpp_rows(pool):
    assert code_tests_batch(_mbpp_items(MBPP, "code"), pool=pool) == [1.0, 1.0, 1.0]
    wrong = code_tests_batch(_mbpp_items(MBPP, "wrong"), pool=pool)
    assert wrong == [0.0, pytest.approx(1 / 3), 0.0]  # len(Counter('aab')) == 2 is right once


@pytest.mark.parametrize("row, field, ok, bad", STDIO, ids=["apps", "codecontests", "lcb"])
def test_stdio_rows(pool, row, field, ok, bad):
    items = [{"completion": c, "tests": row[field]} for c in (ok, bad)]
    assert code_tests_batch(items, pool=pool) == [1.0, 0.5]


def test_stdio_per_case_timeout_and_output(pool):
    tests = [{"input": "1\n", "output": "1\n"}, {"input": "0\n", "output": "0\n"}]
    code = "n = int(input())\nwhile n == 0:\n    pass\nprint(n)\n"
    assert code_tests_batch([{"completion": code, "tests": tests}], pool=pool,
                            test_timeout_s=0.5) == [0.5]
    flood = "print('x' * (4 << 20))\n"
    assert code_tests_batch([{"completion": flood, "tests": tests}], pool=pool) == [0.0]


def test_livecodebench_functional(pool):
    row = {
        "public_test_cases": json.dumps([
            {"input": "[1, 2, 3]\n2", "output": "[3, 4, 5]", "testtype": "functional"},
            {"input": "[]\n7", "output": "[]", "testtype": "functional"}]),
        "metadata": json.dumps({"func_name": "addAll"}),
    }
    ok = ("```python\nclass Solution:\n    def addAll(self, nums, k):\n"
          "        return [x + k for x in nums]\n```")
    bad = "class Solution:\n    def addAll(self, nums, k):\n        return nums\n"
    items = [{"completion": c, "tests": row["public_test_cases"], "metadata": row["metadata"]}
             for c in (ok, bad)]
    assert code_tests_batch(items, pool=pool) == [1.0, 0.5]


def test_apps_call_based_and_tolerance(pool):
    tests = {"inputs": [[2], [3]], "outputs": [[2, 4], [3, 9]], "fn_name": "sq"}
    ok = "def sq(x):\n    return (x, x * x)\n"  # JSON has no tuples: a tuple equals the list
    assert code_tests_batch([{"completion": ok, "tests": tests}], pool=pool) == [1.0]
    tol = [{"fn": "third", "args": [1], "expected": 0.3333, "abs_tol": 1e-3},
           {"fn": "third", "args": [1], "expected": 0.3333}]
    ok = "def third(x):\n    return x / 3\n"
    assert code_tests_batch([{"completion": ok, "tests": tol}], pool=pool) == [0.5]


def test_bad_specs_name_the_problem():
    with pytest.raises(ValueError, match="func_name"):
        build_spec({"tests": [{"input": "1", "output": "1", "testtype": "functional"}]}, "")
    with pytest.raises(ValueError, match="entry_point"):
        build_spec({"tests": {"test": "def check(c): pass", "entry_point": "not a name"}}, "")
    with pytest.raises(ValueError, match="no 'tests' field"):
        build_spec({"completion": "x"}, "")


def test_setup_error_is_the_items_error(pool):
    item = {"completion": "def f(): return 1", "test_list": ["assert f() == 1"],
            "test_setup_code": "raise RuntimeError('broken fixture')", "test_imports": []}
    (out,) = code_tests_batch([item], pool=pool)
    assert isinstance(out, ValueError) and "broken fixture" in str(out)


def test_per_item_reward_takes_the_datasets_own_fields(pool):
    from jaxrl.rewards.rewards import get_reward

    fn = get_reward("code_tests").fn
    prompt = 'def inc(x: int) -> int:\n    """x + 1"""\n'
    test = "def check(candidate):\n    assert candidate(1) == 2\n    assert candidate(-1) == 0\n"
    assert fn(prompt, "    return x + 1\n", test=test, entry_point="inc", pool=pool) == 1.0
    assert fn(prompt, "    return x\n", test=test, entry_point="inc", pool=pool) == 0.0
    row = MBPP[0]
    assert fn("p", row["code"], test_list=row["test_list"], test_setup_code="",
              test_imports=[], pool=pool, mode="all") == 1.0


def test_iterators_and_ranges_keep_python_semantics(pool):
    code = ("def evens(n):\n    return (i for i in range(n) if i % 2 == 0)\n"
            "def rng(n):\n    return range(0, n, 2)\n")
    tests = ["assert list(evens(7)) == [0, 2, 4, 6]", "assert evens(3) != [0, 2]",
             "assert rng(5) == range(0, 5, 2)",
             "assert sorted(evens(5), reverse=True) == [4, 2, 0]"]
    assert code_tests_batch([{"completion": code, "tests": tests}], pool=pool) == [1.0]
