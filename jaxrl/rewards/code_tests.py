"""The `code_tests` reward: run a completion's code against its tests in the sandbox pool.

Test code and function cases: one sandbox job per completion runs the two-process harness of
`code_harness`: the candidate's code runs in a fresh interpreter that only computes values, and a
clean judge process, which never loads the candidate's code, runs the test code (with proxies
standing in for the candidate's functions), compares, and writes the verdicts on a channel the
candidate cannot reach; the trusted side here only counts `<index> pass|fail` lines.
Stdin/stdout cases: one plain job per case; the expected output never enters the sandbox and the
normalised stdout is compared here (bounded: stdout is capped by the pool). Test formats: see
`code_formats` (HumanEval, MBPP, stdin/stdout pairs as in APPS / CodeContests / LiveCodeBench,
function calls, assert lists). The exit status is never a verdict.

`TestCase`, `harness_source`, `parse_harness_output` and `values_equal` are the older
single-process harness, kept for `jaxrl.data.pysynth` (its own tests compare values on the
trusted side); `code_tests` no longer uses them.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards import code_formats, code_harness
from jaxrl.rewards.types import MAX_CODE_BYTES, SandboxJob, SandboxResult

MODES = ("fraction", "all")
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


def normalize_stdout(text: str) -> str:
    """Lines with trailing whitespace removed; leading/trailing blank lines dropped."""
    return "\n".join(line.rstrip() for line in text.strip("\n").splitlines()).strip("\n")


# --- batch scoring -----------------------------------------------------------------------------




# --- batch scoring -----------------------------------------------------------------------------


def code_tests_batch(
    items: Sequence[Mapping[str, Any]],
    *,
    pool,
    mode: str = "fraction",
    test_timeout_s: float = 5.0,
    memory_mb: int = 512,
    max_job_timeout_s: float = 120.0,
) -> list[float | Exception]:
    """Scores many completions with ONE `pool.run` call. Per item: the fraction of test cases
    passed (mode="fraction") or 1.0 only if all pass (mode="all"); a bad test spec gives its
    exception.

    Jobs: one judge job per completion for its test code / function cases (each case bounded by
    `test_timeout_s`; the job by that per case plus start-up, at most `max_job_timeout_s`), and
    one plain job per stdin/stdout case (`test_timeout_s` each), whose expected output never
    enters the sandbox: its stdout is compared here, after normalisation.
    """
    if mode not in MODES:
        raise ValueError(f"code_tests mode must be one of {MODES}, got {mode!r}")
    if pool is None:
        raise ValueError("code_tests needs a sandbox pool: pass pool=LocalSandboxPool(...)")
    out: list[float | Exception] = [0.0] * len(items)
    jobs: list[SandboxJob] = []
    plan: list[tuple[int, str, Any]] = []  # (item, "judge" | "stdio", cases | expected) per job
    totals = [0] * len(items)
    for k, item in enumerate(items):
        code = extract_code(str(item.get("completion", "")))
        try:
            spec = code_formats.build_spec(item, code, timeout_s=test_timeout_s)
            item_jobs, item_plan = _jobs_for(k, spec, test_timeout_s, memory_mb,
                                             max_job_timeout_s)
        except Exception as e:  # noqa: BLE001 - a bad spec is this item's error only
            out[k] = e
            continue
        totals[k] = len(spec["cases"])
        jobs += item_jobs
        plan += item_plan
    if not jobs:
        return out
    results = pool.run(jobs)
    if len(results) != len(jobs):
        raise RuntimeError(f"pool returned {len(results)} results for {len(jobs)} jobs")
    passed = [0] * len(items)
    for (k, kind, payload), res in zip(plan, results, strict=True):
        if isinstance(out[k], Exception):
            continue
        if kind == "stdio":
            passed[k] += _stdio_passes(res, payload)
            continue
        verdicts, setup_error = code_harness.parse_verdicts(res.stdout, payload)
        if setup_error is not None:
            out[k] = ValueError(f"the item's test setup code failed: {setup_error}")
        passed[k] += sum(verdicts)
    for k in range(len(items)):
        if not isinstance(out[k], Exception) and totals[k]:
            frac = passed[k] / totals[k]
            out[k] = float(frac) if mode == "fraction" else float(passed[k] == totals[k])
    return out


def _jobs_for(k: int, spec: dict, timeout_s: float, memory_mb: int, max_job_timeout_s: float):
    jobs, plan = [], []
    for c in spec["cases"]:
        if c["k"] == "stdio":
            jobs.append(SandboxJob(code=spec["candidate"], stdin=c["stdin"], timeout_s=timeout_s,
                                   memory_mb=memory_mb))
            plan.append((k, "stdio", c["expected"]))
    judged = [c for c in spec["cases"] if c["k"] != "stdio"]
    if judged:
        src = code_harness.judge_source({**spec, "cases": judged})
        if len(src) > MAX_CODE_BYTES:
            raise ValueError(f"tests + code make a {len(src)}-char job, over the sandbox's "
                             f"{MAX_CODE_BYTES}")
        timeout = min(max_job_timeout_s, timeout_s * (len(judged) + 1) + 2.0)
        jobs.append(SandboxJob(code=src, timeout_s=timeout, memory_mb=memory_mb))
        plan.append((k, "judge", len(judged)))
    return jobs, plan


def _stdio_passes(result: SandboxResult, expected: str) -> bool:
    # The status only rules out runs that broke a limit; "ok" vs "error" (exit code) is no verdict.
    if result.status not in ("ok", "error"):
        return False
    return normalize_stdout(result.stdout) == normalize_stdout(expected)
