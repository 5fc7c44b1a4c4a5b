"""The `code_tests` reward: run a completion's code against test cases in the sandbox pool.

Trust boundary: test *inputs* go into the sandbox, expected *outputs* never do. The sandboxed
program only runs the candidate on the inputs and prints what it produced; the verdict is taken on
the trusted side by comparing those values with the expected ones. Nothing the candidate can do
inside the sandbox (exit(0), os._exit(0), patched builtins, an object whose `__eq__` is always True,
printing fake result lines) can make a wrong value compare equal, because the comparison happens
here, between plain data parsed with `ast.literal_eval`. The exit status is never a verdict.

Test formats (the `tests` example field; a JSON string of any of these is accepted too):
  * stdin/stdout:  [{"input": "1 2\\n", "output": "3\\n"}, ...]   (keys stdin/stdout also work)
    One sandbox job per case; stdout is compared line by line, trailing whitespace ignored.
  * function call: [{"fn": "add", "args": [1, 2], "kwargs": {}, "expected": 3}, ...]
  * asserts:       ["assert add(1, 2) == 3", ...]  -> the left side runs in the sandbox, the
    literal right side is the expected value (also `assert f(x)` / `assert not f(x)`).
  * APPS style:    {"inputs": [...], "outputs": [...], "fn_name": "f"?}
  Function and assert cases of one completion share one sandbox job: a harness loads the code once
  and prints one `<nonce> <index> value <repr>` line per case. Several of the same index (forged
  lines) fail that case.
"""

from __future__ import annotations

import ast
import dataclasses
import json
import math
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards.types import SandboxJob, SandboxResult

MODES = ("fraction", "all")
_MAX_VALUE_CHARS = 1 << 20
_CODE_BLOCK_RE = re.compile(r"```[ \t]*(?:python3?|py)?[ \t]*\n(.*?)```", re.DOTALL)


@dataclasses.dataclass(frozen=True)
class TestCase:
    """One test: kind "stdio" (stdin -> expected stdout), "call" (fn(*args, **kwargs)) or "expr"."""

    kind: str
    expected: Any
    stdin: str = ""
    fn: str = ""
    args: tuple = ()
    kwargs: Mapping[str, Any] = dataclasses.field(default_factory=dict)
    expr: str = ""


def extract_code(completion: str) -> str:
    """The last fenced code block (```python ... ```) of a completion, else the whole text."""
    blocks = _CODE_BLOCK_RE.findall(completion)
    return blocks[-1] if blocks else completion


def _from_assert(src: str) -> list[TestCase]:
    try:
        tree = ast.parse(src)
    except SyntaxError as e:
        raise ValueError(f"test assert does not parse: {src[:200]!r} ({e})") from None
    cases = []
    for node in tree.body:
        if not isinstance(node, ast.Assert):
            raise ValueError(
                f"test code must be assert statements only, got: {ast.unparse(node)!r}"
            )
        t = node.test
        if isinstance(t, ast.Compare) and len(t.ops) == 1 and isinstance(t.ops[0], ast.Eq | ast.Is):
            left, right = t.left, t.comparators[0]
            for run, lit in ((left, right), (right, left)):
                try:
                    expected = ast.literal_eval(lit)
                except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
                    continue
                cases.append(TestCase("expr", expected, expr=ast.unparse(run)))
                break
            else:
                raise ValueError(f"assert needs a literal on one side of ==: {ast.unparse(t)!r}")
        elif isinstance(t, ast.Call):
            cases.append(TestCase("expr", True, expr=f"bool({ast.unparse(t)})"))
        elif (
            isinstance(t, ast.UnaryOp)
            and isinstance(t.op, ast.Not)
            and isinstance(t.operand, ast.Call)
        ):
            cases.append(TestCase("expr", False, expr=f"bool({ast.unparse(t.operand)})"))
        else:
            raise ValueError(
                f"unsupported assert {ast.unparse(t)!r}: use `assert <expr> == <literal>`, "
                "`assert f(...)` or `assert not f(...)` (the expected value must stay outside "
                "the sandbox)"
            )
    return cases


def parse_tests(tests: Any) -> list[TestCase]:
    """Normalises the `tests` field (formats in the module docstring) to a list of TestCase."""
    if isinstance(tests, str):
        stripped = tests.strip()
        tests = json.loads(stripped) if stripped[:1] in "[{" else [stripped]
    if isinstance(tests, Mapping):
        if "inputs" not in tests or "outputs" not in tests:
            raise ValueError(
                f"a dict of tests needs 'inputs' and 'outputs', got keys {sorted(tests)}"
            )
        ins, outs, fn = tests["inputs"], tests["outputs"], tests.get("fn_name")
        if len(ins) != len(outs):
            raise ValueError(f"tests have {len(ins)} inputs but {len(outs)} outputs")
        if fn:
            return [
                TestCase("call", o, fn=fn, args=tuple(i if isinstance(i, list) else [i]))
                for i, o in zip(ins, outs, strict=True)
            ]
        return [TestCase("stdio", _join(o), stdin=_join(i)) for i, o in zip(ins, outs, strict=True)]
    if not isinstance(tests, Sequence) or not tests:
        raise ValueError(
            f"tests must be a non-empty list (or dict/JSON string), got {tests!r:.200}"
        )
    cases: list[TestCase] = []
    for t in tests:
        if isinstance(t, str):
            cases.extend(_from_assert(t))
        elif isinstance(t, Mapping) and ("input" in t or "stdin" in t):
            out = t.get("output", t.get("stdout"))
            if out is None:
                raise ValueError(f"stdin test needs 'output' (or 'stdout'); got keys {sorted(t)}")
            cases.append(TestCase("stdio", _join(out), stdin=_join(t.get("input", t.get("stdin")))))
        elif isinstance(t, Mapping) and "fn" in t and "expected" in t:
            cases.append(
                TestCase(
                    "call",
                    t["expected"],
                    fn=str(t["fn"]),
                    args=tuple(t.get("args", ())),
                    kwargs=dict(t.get("kwargs", {})),
                )
            )
        else:
            raise ValueError(
                f"unrecognised test case {t!r:.200}: expected {{'input', 'output'}}, "
                "{'fn', 'args', 'expected'} or an assert string"
            )
    if not cases:
        raise ValueError("no test cases")
    return cases


def _join(x: Any) -> str:
    return "\n".join(map(str, x)) if isinstance(x, list) else str(x)


# --- in-sandbox harness ---------------------------------------------------------------

_HARNESS = r"""
import ast as _ast, os as _os
_NONCE = __NONCE__
_TESTS = _ast.literal_eval(__TESTS__)
_SRC = __SRC__


def _main(src, tests, nonce, fd=_os.dup(1), write=_os.write, exit=_os._exit, type=type,
          repr=repr, enumerate=enumerate, compile=compile, eval=eval, exec=exec, dict=dict,
          list=list, tuple=tuple, set=set, frozenset=frozenset, BaseException=BaseException,
          TypeError=TypeError, ValueError=ValueError, str=str, len=len):
    # Builtins are bound above, before the candidate runs: patching `builtins` or `os` from the
    # candidate's code does not change how results are written.
    leaf = (int, float, complex, str, bytes, bool, type(None))

    def emit(i, kind, payload):
        data = ("%s %d %s %s\n" % (nonce, i, kind, payload)).encode("utf-8", "backslashreplace")
        while data:
            data = data[write(fd, data):]

    def plain(v, depth=0):
        t = type(v)
        if depth > 50:
            raise ValueError("result nested too deeply")
        if t in leaf:
            return v
        if t in (list, tuple, set, frozenset):
            return t([plain(x, depth + 1) for x in v])
        if t is dict:
            return {plain(k, depth + 1): plain(x, depth + 1) for k, x in v.items()}
        raise TypeError("result of type %s is not plain data" % t.__name__)

    ns = {"__name__": "__solution__"}
    try:
        exec(compile(src, "<solution>", "exec"), ns)
    except BaseException as e:
        emit(-1, "load_error", type(e).__name__)
        exit(0)
    for i, t in enumerate(tests):
        try:
            if t[0] == "call":
                v = ns[t[1]](*t[2], **t[3])
            else:
                v = eval(compile(t[1], "<test>", "eval"), ns)
            emit(i, "value", repr(plain(v)))
        except BaseException as e:
            emit(i, "error", type(e).__name__)
    exit(0)


_main(_SRC, _TESTS, _NONCE)
"""


def harness_source(code: str, cases: Sequence[TestCase], nonce: str) -> str:
    """The sandbox program for call/expr cases. It holds inputs only, never expected values."""
    spec = [
        ("call", c.fn, list(c.args), dict(c.kwargs)) if c.kind == "call" else ("expr", c.expr)
        for c in cases
    ]
    return (
        _HARNESS.replace("__NONCE__", repr(nonce))
        .replace("__TESTS__", repr(repr(spec)))
        .replace("__SRC__", repr(code))
    )


def parse_harness_output(stdout: str, nonce: str, n: int) -> list[tuple[str, str] | None]:
    """Per case: ("value", repr) / ("error", name), or None if absent or forged twice."""
    out: list[tuple[str, str] | None] = [None] * n
    seen: set[int] = set()
    prefix = nonce + " "
    for line in stdout.splitlines():
        if not line.startswith(prefix):
            continue
        parts = line[len(prefix) :].split(" ", 2)
        if len(parts) != 3:
            continue
        try:
            i = int(parts[0])
        except ValueError:
            continue
        if i == -1 and parts[1] == "load_error":
            return [("error", "load_error:" + parts[2])] * n
        if not 0 <= i < n:
            continue
        out[i] = None if i in seen else (parts[1], parts[2])  # a second line voids the case
        seen.add(i)
    return out


def values_equal(actual: Any, expected: Any, rel_tol: float = 1e-9, abs_tol: float = 1e-9) -> bool:
    """Python `==` on plain data, except floats compare with tolerance and list == tuple."""
    num = (int, float)
    if isinstance(actual, num) and isinstance(expected, num):
        if isinstance(actual, float) or isinstance(expected, float):
            return math.isclose(actual, expected, rel_tol=rel_tol, abs_tol=abs_tol)
        return actual == expected
    seq = (list, tuple)
    if isinstance(actual, seq) and isinstance(expected, seq):
        return len(actual) == len(expected) and all(
            values_equal(a, e, rel_tol, abs_tol) for a, e in zip(actual, expected, strict=True)
        )
    if isinstance(actual, dict) and isinstance(expected, dict):
        return actual.keys() == expected.keys() and all(
            values_equal(actual[k], expected[k], rel_tol, abs_tol) for k in actual
        )
    return type(actual) is type(expected) and actual == expected


def _value_passes(entry: tuple[str, str] | None, expected: Any) -> bool:
    if entry is None or entry[0] != "value" or len(entry[1]) > _MAX_VALUE_CHARS:
        return False
    try:
        actual = ast.literal_eval(entry[1])
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False
    return values_equal(actual, expected)


def normalize_stdout(text: str) -> str:
    """Lines with trailing whitespace removed; leading/trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


def _stdio_passes(result: SandboxResult, expected: str) -> bool:
    # The status only rules out runs that broke a limit; "ok" vs "error" (exit code) is no verdict.
    if result.status not in ("ok", "error"):
        return False
    return normalize_stdout(result.stdout) == normalize_stdout(expected)


# --- batch scoring -----------------------------------------------------------------------------


def code_tests_batch(
    items: Sequence[Mapping[str, Any]],
    *,
    pool,
    mode: str = "fraction",
    test_timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_job_timeout_s: float = 60.0,
) -> list[float | Exception]:
    """Scores many completions with ONE `pool.run` call. Per item: the fraction of tests passed
    (mode="fraction") or 1.0 only if all pass (mode="all"); a bad test spec gives its exception.

    `test_timeout_s` bounds each stdin test; a harness job gets that per case, at most
    `max_job_timeout_s`.
    """
    if mode not in MODES:
        raise ValueError(f"code_tests mode must be one of {MODES}, got {mode!r}")
    if pool is None:
        raise ValueError("code_tests needs a sandbox pool: pass pool=LocalSandboxPool(...)")
    out: list[float | Exception] = [0.0] * len(items)
    jobs: list[SandboxJob] = []
    plan: list[tuple[int, str, Any]] = []  # (item, "stdio"|"harness", payload) per job
    totals: list[int] = [0] * len(items)
    for k, item in enumerate(items):
        try:
            cases = parse_tests(item["tests"])
        except KeyError:
            out[k] = ValueError(f"item has no 'tests' field; fields: {sorted(item)}")
            continue
        except Exception as e:  # noqa: BLE001 - a bad spec is this item's error only
            out[k] = e
            continue
        code = extract_code(str(item.get("completion", "")))
        totals[k] = len(cases)
        for c in cases:
            if c.kind == "stdio":
                jobs.append(
                    SandboxJob(
                        code=code, stdin=c.stdin, timeout_s=test_timeout_s, memory_mb=memory_mb
                    )
                )
                plan.append((k, "stdio", c.expected))
        fn_cases = [c for c in cases if c.kind != "stdio"]
        if fn_cases:
            nonce = secrets.token_hex(16)
            job_timeout = min(max_job_timeout_s, test_timeout_s * len(fn_cases))
            jobs.append(
                SandboxJob(
                    code=harness_source(code, fn_cases, nonce),
                    timeout_s=job_timeout,
                    memory_mb=memory_mb,
                )
            )
            plan.append((k, "harness", (nonce, fn_cases)))
    if not jobs:
        return out
    results = pool.run(jobs)
    if len(results) != len(jobs):
        raise RuntimeError(f"pool returned {len(results)} results for {len(jobs)} jobs")
    passed = [0] * len(items)
    for (k, kind, payload), res in zip(plan, results, strict=True):
        if kind == "stdio":
            passed[k] += _stdio_passes(res, payload)
        else:
            nonce, fn_cases = payload
            entries = parse_harness_output(res.stdout, nonce, len(fn_cases))
            passed[k] += sum(
                _value_passes(e, c.expected) for e, c in zip(entries, fn_cases, strict=True)
            )
    for k in range(len(items)):
        if isinstance(out[k], Exception) or totals[k] == 0:
            continue
        frac = passed[k] / totals[k]
        out[k] = float(frac) if mode == "fraction" else float(passed[k] == totals[k])
    return out
