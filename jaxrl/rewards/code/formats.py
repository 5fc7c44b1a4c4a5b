"""Test formats of `code_tests`: public datasets' own fields -> the judge's spec (`harness`).

Accepted, in the item's `tests` field (a JSON string of any of these too) or as the dataset's own
top-level fields when `tests` is absent:

  * HumanEval:  {"prompt", "test", "entry_point"} (`test` defines `check(candidate)`); the
    candidate program is `prompt + completion code`, so a body-only continuation and a full
    function both work. The prompt's helpers run in the judge as trusted code.
  * MBPP:       {"test_list": [asserts], "test_setup_code": str, "test_imports": [str]}
  * stdin/stdout: [{"input": ..., "output": ...}] (keys stdin/stdout too; LiveCodeBench's
    `testtype: "stdin"` rows), APPS {"inputs": [...], "outputs": [...]} and CodeContests
    {"input": [...], "output": [...]}: stdout is compared after removing
    trailing whitespace per line and leading/trailing blank lines; each case has its own timeout.
  * function calls: [{"fn", "args", "kwargs"?, "expected", "rel_tol"?, "abs_tol"?}], APPS
    {"inputs", "outputs", "fn_name"} or LiveCodeBench `testtype: "functional"` rows (JSON lines;
    `Solution().<metadata.func_name>`): compared like their JSON (a tuple equals a list), exactly
    unless a tolerance is given.
  * asserts:    ["assert f(1) == 2", ...]: any Python test code, one case per top-level assert.

Test code runs with Python's own semantics in the judge; modules it names from `AUTO_IMPORTS`
are imported for it (so a test may use `math` whether or not the candidate imported it).
"""

from __future__ import annotations

import ast
import json
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards.code.wire import encode

AUTO_IMPORTS = ("math", "cmath", "re", "json", "collections", "itertools", "functools", "heapq",
                "bisect", "string", "random", "fractions", "decimal", "statistics", "typing",
                "operator", "copy")
FORMATS = ("HumanEval {prompt, test, entry_point}", "MBPP {test_list, test_setup_code?, "
           "test_imports?}", "[{input, output}]", "{inputs, outputs, fn_name?}",
           "[{fn, args, expected}]", "[assert strings]")


def _parse(src: str, what: str) -> ast.Module:
    if not isinstance(src, str):
        raise ValueError(f"{what} must be a string of Python, got {type(src).__name__}")
    try:
        return ast.parse(src)
    except SyntaxError as e:
        raise ValueError(f"{what} does not parse: {src[:200]!r} ({e})") from None


def _assert_cases(src: str) -> list[dict]:
    tree = _parse(src, "test assert")
    if tree.body and all(isinstance(n, ast.Assert) for n in tree.body):
        return [{"k": "code", "src": ast.unparse(n)} for n in tree.body]
    return [{"k": "code", "src": src}]


def _join(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


def _stdio(inp: Any, out: Any) -> dict:
    return {"k": "stdio", "stdin": _join(inp), "expected": _join(out)}


def _call(fn: str, args: Any, kwargs: Any, expected: Any, tol=None) -> dict:
    if not isinstance(fn, str) or not fn.isidentifier():
        raise ValueError(f"test 'fn' must be a function name, got {fn!r:.100}")
    if not isinstance(kwargs, Mapping):
        raise ValueError(f"test 'kwargs' must be a dict, got {kwargs!r:.100}")
    try:
        wire = [encode(list(args)), encode(dict(kwargs)), encode(expected)]
    except (TypeError, ValueError) as e:
        raise ValueError(f"test values must be plain data: {e}") from None
    case = {"k": "call", "fn": fn, "args": wire[0], "kwargs": wire[1], "expected": wire[2],
            "json": True}
    if tol is not None:
        case["tol"] = tol
    return case


def _humaneval(t: Mapping, prompt: str) -> tuple[list[str], list[dict], str, str]:
    entry, test = t["entry_point"], t["test"]
    if not isinstance(entry, str) or not entry.isidentifier():
        raise ValueError(f"HumanEval 'entry_point' must be a function name, got {entry!r:.100}")
    prompt = str(t.get("prompt") or prompt)
    _parse(test, "HumanEval 'test'")
    if prompt:
        _parse(prompt, "HumanEval 'prompt'")
    return [prompt, test], [{"k": "code", "src": f"check({entry})"}], entry, prompt


def _mbpp(t: Mapping) -> tuple[list[str], list[dict]]:
    tests = t["test_list"]
    if isinstance(tests, str):
        tests = [tests]
    imports = t.get("test_imports") or []
    setup = ["\n".join(imports) if isinstance(imports, list) else str(imports),
             str(t.get("test_setup_code") or "")]
    for s in setup:
        _parse(s, "MBPP test_setup_code/test_imports")
    cases = [c for src in tests for c in _assert_cases(src)]
    return setup, cases


def _func_name(item: Mapping) -> str | None:
    """LiveCodeBench keeps the function of its functional tests in `metadata` (JSON)."""
    meta = item.get("metadata")
    if isinstance(meta, str):
        try:
            meta = json.loads(meta)
        except json.JSONDecodeError:
            return None
    return meta.get("func_name") if isinstance(meta, Mapping) else None


def _functional(t: Mapping, func_name: str | None) -> dict:
    """A LiveCodeBench functional case: one JSON value per input line, JSON output. LeetCode
    style solutions are `class Solution` with a method: the call is `Solution().<func_name>`."""
    if not func_name:
        raise ValueError("functional test cases need the function name in the item's "
                         "metadata {'func_name': ...}")
    try:
        args = [json.loads(line) for line in str(t["input"]).splitlines() if line.strip()]
        expected = json.loads(str(t["output"]))
    except json.JSONDecodeError as e:
        raise ValueError(f"functional test values must be JSON: {e}") from None
    case = _call("Solution", args, {}, expected)
    case["fn"] = f"Solution.{func_name}"
    return case


def _list_cases(tests: Sequence, func_name: str | None = None) -> list[dict]:
    cases: list[dict] = []
    for t in tests:
        if isinstance(t, str):
            cases.extend(_assert_cases(t))
        elif isinstance(t, Mapping) and t.get("testtype") == "functional":
            cases.append(_functional(t, func_name))
        elif isinstance(t, Mapping) and ("input" in t or "stdin" in t):
            out = t.get("output", t.get("stdout"))
            if out is None:
                raise ValueError(f"stdin test needs 'output' (or 'stdout'); got keys {sorted(t)}")
            cases.append(_stdio(t.get("input", t.get("stdin")), out))
        elif isinstance(t, Mapping) and "fn" in t and "expected" in t:
            tol = None
            if "rel_tol" in t or "abs_tol" in t:
                tol = [float(t.get("rel_tol", 0.0)), float(t.get("abs_tol", 0.0))]
            cases.append(_call(t["fn"], t.get("args", ()), t.get("kwargs", {}), t["expected"],
                               tol))
        else:
            raise ValueError(f"unrecognised test case {t!r:.200}: expected one of {FORMATS}")
    return cases


def build_spec(item: Mapping[str, Any], code: str) -> dict:
    """The judge's spec for one item (its tests in any format above) and candidate `code`.

    Raises ValueError naming the problem for a bad or unrecognised test spec.
    """
    tests = item.get("tests")
    if tests is None:
        if "test" in item and "entry_point" in item:
            tests = item
        elif "test_list" in item:
            tests = item
        else:
            raise ValueError(f"item has no 'tests' field (nor HumanEval 'test' + 'entry_point' "
                             f"or MBPP 'test_list'); fields: {sorted(item)}")
    if isinstance(tests, str):
        stripped = tests.strip()
        try:
            tests = json.loads(stripped) if stripped[:1] in "[{" else [stripped]
        except json.JSONDecodeError as e:
            raise ValueError(f"tests string is not valid JSON: {e}") from None
    setup: list[str] = []
    entry = None
    candidate = code
    if isinstance(tests, Mapping) and "test" in tests and "entry_point" in tests:
        # A `tests` dict carries its own prompt; a HumanEval row's prompt is the row's field.
        setup, cases, entry, prompt = _humaneval(tests, "")
        if prompt:
            candidate = prompt + ("" if prompt.endswith("\n") else "\n") + code
    elif isinstance(tests, Mapping) and "test_list" in tests:
        setup, cases = _mbpp(tests)
    elif isinstance(tests, Mapping) and isinstance(tests.get("input"), list):
        ins, outs = tests["input"], tests.get("output")  # CodeContests public/private_tests
        if not isinstance(outs, list) or len(ins) != len(outs):
            raise ValueError(f"tests 'input' and 'output' must be lists of one length, got "
                             f"{type(outs).__name__} {outs!r:.100}")
        cases = [_stdio(i, o) for i, o in zip(ins, outs, strict=True)]
    elif isinstance(tests, Mapping):
        if "inputs" not in tests or "outputs" not in tests:
            raise ValueError(f"unrecognised tests dict with keys {sorted(tests)}: expected one "
                             f"of {FORMATS}")
        ins, outs, fn = tests["inputs"], tests["outputs"], tests.get("fn_name")
        if len(ins) != len(outs):
            raise ValueError(f"tests have {len(ins)} inputs but {len(outs)} outputs")
        if fn:
            cases = [_call(fn, i if isinstance(i, list) else [i], {}, o)
                     for i, o in zip(ins, outs, strict=True)]
        else:
            cases = [_stdio(i, o) for i, o in zip(ins, outs, strict=True)]
    elif isinstance(tests, Sequence) and tests:
        cases = _list_cases(tests, _func_name(item))
    else:
        raise ValueError(f"tests must be a non-empty list, a dict or a JSON string of one, got "
                         f"{tests!r:.200}; formats: {FORMATS}")
    if not cases:
        raise ValueError("no test cases")
    trusted = [*setup, *(c["src"] for c in cases if c["k"] == "code")]
    return {
        "candidate": candidate,
        "setup": setup,
        "auto_imports": _auto_imports(trusted),
        "entry": entry,
        "cases": cases,
    }


def _auto_imports(sources: list[str]) -> list[str]:
    """Modules of AUTO_IMPORTS that the test code names without importing them."""
    used: set[str] = set()
    for src in sources:
        for node in ast.walk(ast.parse(src)):
            if isinstance(node, ast.Name) and node.id in AUTO_IMPORTS:
                used.add(node.id)
    return sorted(used)
