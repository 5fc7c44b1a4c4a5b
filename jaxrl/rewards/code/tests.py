"""The `code_tests` reward: run a completion's code against its tests in the sandbox pool.

Test code and function cases: judge jobs (`harness`, `judge`): each candidate runs in
a process of its own that only computes values (forked from a fork server that never held test
data, or a fresh interpreter), and a clean judge process, which never loads a candidate's code,
runs the test code (with proxies standing in for the candidate's functions), compares, and
writes the verdicts on a channel no candidate can reach; the trusted side here only counts
`<item> <case> pass|fail` lines.
Stdin/stdout cases: one plain job per case; the expected output never enters the sandbox and the
normalised stdout is compared here (bounded: stdout is capped by the pool). Test formats: see
`formats` (HumanEval, MBPP, stdin/stdout pairs as in APPS / CodeContests / LiveCodeBench,
function calls, assert lists). The exit status is never a verdict.

`TestCase`, `harness_source`, `parse_harness_output` and `values_equal` are the older
single-process harness, kept for `jaxrl.data.pysynth`; `code_tests` no longer uses them. They have
the weaknesses issue 17 found (the candidate can read the nonce and print result lines; values
are parsed with `ast.literal_eval` on the trusted side, unbounded in time): pysynth compares only
values the candidate computes itself, but it should move to the judge.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards.code import formats, harness
from jaxrl.sandbox.types import MAX_CODE_BYTES, SandboxJob, SandboxResult

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
    items_per_job: int | None = None,
) -> list[float | Exception]:
    """Scores many completions with one `pool.run` call (two if a judge job died early). Per
    item: the fraction of test cases passed (mode="fraction") or 1.0 only if all pass
    (mode="all"); a bad test spec gives its exception.

    Jobs: judge jobs for test code and function cases, `items_per_job` completions each (default:
    enough jobs for two per pool worker, at most 16 items), each case bounded by `test_timeout_s`
    and each completion by `max_job_timeout_s`; and one plain job per stdin/stdout case
    (`test_timeout_s` each), whose expected output never enters the sandbox: its stdout is
    compared here, after normalisation.
    """
    if mode not in MODES:
        raise ValueError(f"code_tests mode must be one of {MODES}, got {mode!r}")
    if pool is None:
        raise ValueError("code_tests needs a sandbox pool: pass pool=LocalSandboxPool(...)")
    if items_per_job is not None and not (isinstance(items_per_job, int) and items_per_job >= 1):
        raise ValueError(f"items_per_job must be a positive int or None, got {items_per_job!r}")
    out: list[float | Exception] = [0.0] * len(items)
    stdio_jobs: list[SandboxJob] = []
    stdio_plan: list[tuple[int, str]] = []  # (item, expected stdout) per stdio job
    judged: list[dict] = []  # judge specs of the items with test code / function cases
    judged_ids: list[int] = []
    totals = [0] * len(items)
    for k, item in enumerate(items):
        try:
            spec = formats.build_spec(item, extract_code(str(item.get("completion", ""))))
        except Exception as e:  # noqa: BLE001 - a bad spec is this item's error only
            out[k] = e
            continue
        totals[k] = len(spec["cases"])
        for c in spec["cases"]:
            if c["k"] == "stdio":
                stdio_jobs.append(SandboxJob(code=spec["candidate"], stdin=c["stdin"],
                                             timeout_s=test_timeout_s, memory_mb=memory_mb))
                stdio_plan.append((k, c["expected"]))
        cases = [c for c in spec["cases"] if c["k"] != "stdio"]
        if cases:
            judged.append({**spec, "cases": cases})
            judged_ids.append(k)
    per_job = items_per_job or harness.auto_per_job(
        len(judged), getattr(pool, "num_workers", None))
    kw = dict(timeout_s=test_timeout_s, memory_mb=memory_mb, max_item_timeout_s=max_job_timeout_s)
    jobs, groups = harness.judge_jobs(judged, per_job=per_job, **kw)
    for job, group in zip(jobs, groups, strict=True):
        if len(job.code) > MAX_CODE_BYTES:
            for i in group:
                out[judged_ids[i]] = ValueError(
                    f"tests + code make a {len(job.code)}-char judge job, over the sandbox's "
                    f"{MAX_CODE_BYTES}")
    ok_jobs = [(j, g) for j, g in zip(jobs, groups, strict=True) if len(j.code) <= MAX_CODE_BYTES]
    passed = [0] * len(items)
    results = _run(pool, stdio_jobs + [j for j, _ in ok_jobs])
    for (k, expected), res in zip(stdio_plan, results[:len(stdio_jobs)], strict=True):
        passed[k] += _stdio_passes(res, expected)
    rerun: list[int] = []
    for (_, group), res in zip(ok_jobs, results[len(stdio_jobs):], strict=True):
        rerun += _count(res, group, judged, judged_ids, passed, out)
    if rerun:  # a job died before these items started: each alone, so no neighbour can hurt it
        jobs, groups = harness.judge_jobs([judged[i] for i in rerun], per_job=1, **kw)
        for res, group in zip(_run(pool, jobs), groups, strict=True):
            _count(res, [rerun[group[0]]], judged, judged_ids, passed, out)
    for k in range(len(items)):
        if not isinstance(out[k], Exception) and totals[k]:
            frac = passed[k] / totals[k]
            out[k] = float(frac) if mode == "fraction" else float(passed[k] == totals[k])
    return out


def _run(pool, jobs: list[SandboxJob]) -> list[SandboxResult]:
    if not jobs:
        return []
    results = pool.run(jobs)
    if len(results) != len(jobs):
        raise RuntimeError(f"pool returned {len(results)} results for {len(jobs)} jobs")
    return results


def _count(res: SandboxResult, group: list[int], judged: list[dict], judged_ids: list[int],
           passed: list[int], out: list) -> list[int]:
    """Adds a judge job's passes into `passed`; returns the items it never started (when it
    judged more than one)."""
    verdicts = harness.parse_verdicts(res.stdout, [len(judged[i]["cases"]) for i in group])
    not_started = []
    for i, v in zip(group, verdicts, strict=True):
        k = judged_ids[i]
        if not v["started"] and len(group) > 1:
            not_started.append(i)
        elif v["setup_error"] is not None and v["setup_error"].startswith("infra_error"):
            out[k] = RuntimeError(f"code_tests could not run the item: {v['setup_error']}")
        elif v["setup_error"] is not None:
            out[k] = ValueError(f"the item's test setup code failed: {v['setup_error']}")
        else:
            passed[k] += sum(v["passed"])
    return not_started


def _stdio_passes(result: SandboxResult, expected: str) -> bool:
    # The status only rules out runs that broke a limit; "ok" vs "error" (exit code) is no verdict.
    if result.status not in ("ok", "error"):
        return False
    return normalize_stdout(result.stdout) == normalize_stdout(expected)
