"""The trusted side of the `code_tests` harness: building judge jobs and reading their verdicts.

The programs that run in the sandbox (the judge, the candidate bootstrap, the fork server and
the wire format of values) are in `judge`; how they keep the verdict out of the candidate's
reach is in its docstring and in docs/sandbox.md. Here:

  * `judge_jobs` packs items (a completion + its tests, from `formats.build_spec`) into judge
    jobs: at most `per_job` items each, never two items with the same tests in one job (the items
    of one job share a sandbox, and a candidate that sabotaged its neighbours must not be able to
    hurt the other samples of its own prompt);
  * `parse_verdicts` reads `start i`, `<item> <case> pass|fail <reason>` and `done i` lines from
    the job's stdout, which the pool caps: bounded work, nothing of the job is evaluated. Items a
    job never started (it died or timed out on an earlier item) are rerun alone by `code_tests`.
"""

from __future__ import annotations

import json
import marshal
import math
import re
import sys
from collections.abc import Sequence

from jaxrl.rewards.code.judge import BOOT_SRC, JUDGE_SRC, SERVER_SRC
from jaxrl.sandbox.types import MAX_CODE_BYTES, SandboxJob

MAX_ITEMS_PER_JOB = 16  # the judge holds 5 fds per item at the start (RLIMIT_NOFILE is 256)

# The job: a stub that runs the judge from a marshalled code object (compiling the judge's ~400
# lines in every job cost ~3 ms of the job's CPU); any other interpreter compiles the source.
_STUB = """import marshal as _m, sys as _s
SPEC_JSON = {spec!r}
BOOT = {boot!r}
SERVER = {server!r}
_c = None
if _s.implementation.cache_tag == {tag!r}:
    try:
        _c = _m.loads({code!r})
    except Exception:
        _c = None
exec(_c if _c is not None else compile({src!r}, "<judge>", "exec"))
"""
_judge_code: bytes | None = None
_LINE_RE = re.compile(r"(\d{1,4}) (-[12]|\d{1,7}) (pass|fail) ?(.{0,400})|(start|done) (\d{1,4})")


def judge_source(items: Sequence[dict], *, timeout_s: float, max_reply_bytes: int = 8 << 20
                 ) -> str:
    """The sandbox program judging `items` (specs from `formats.build_spec`) in turn."""
    global _judge_code
    if _judge_code is None:
        _judge_code = marshal.dumps(compile(JUDGE_SRC, "<judge>", "exec", dont_inherit=True))
    spec = {"items": list(items), "timeout": float(timeout_s), "max_reply": int(max_reply_bytes)}
    return _STUB.format(spec=json.dumps(spec), boot=BOOT_SRC, server=SERVER_SRC,
                        tag=sys.implementation.cache_tag, code=_judge_code, src=JUDGE_SRC)


def test_key(item: dict) -> str:
    """Items with equal keys have the same tests (the samples of one prompt)."""
    return json.dumps([item["setup"], item["cases"], item.get("entry")], sort_keys=True)


def pack(items: Sequence[dict], per_job: int) -> list[list[int]]:
    """Indices of `items` in groups of at most `per_job`, no two with the same `test_key`."""
    per_job = max(1, min(per_job, MAX_ITEMS_PER_JOB))
    groups: list[list[int]] = []
    keys: list[set[str]] = []
    open_groups: list[int] = []  # groups with room
    for i, item in enumerate(items):
        key = test_key(item)
        for g in open_groups:
            if key not in keys[g]:
                break
        else:
            groups.append([])
            keys.append(set())
            open_groups.append(len(groups) - 1)
            g = open_groups[-1]
        groups[g].append(i)
        keys[g].add(key)
        if len(groups[g]) >= per_job:
            open_groups.remove(g)
    return groups


def judge_jobs(items: Sequence[dict], *, per_job: int, timeout_s: float, memory_mb: int,
               max_item_timeout_s: float) -> tuple[list[SandboxJob], list[list[int]]]:
    """Judge jobs for `items` and, per job, the indices of the items it judges."""
    jobs, groups = [], []
    for group in pack(items, per_job):
        code = judge_source([items[i] for i in group], timeout_s=timeout_s)
        if len(code) > MAX_CODE_BYTES and len(group) > 1:  # big tests: one item per job
            split = [[i] for i in group]
            codes = [judge_source([items[i]], timeout_s=timeout_s) for i in group]
        else:
            split, codes = [group], [code]
        for g, c in zip(split, codes, strict=True):
            budget = sum(min(max_item_timeout_s, timeout_s * (len(items[i]["cases"]) + 1) + 2.0)
                         for i in g)
            jobs.append(SandboxJob(code=c, timeout_s=min(3600.0, budget + 5.0),
                                   memory_mb=memory_mb))
            groups.append(g)
    return jobs, groups


def auto_per_job(n_items: int, workers: int | None) -> int:
    """Items per judge job: enough jobs to keep every worker busy twice over, at most 16."""
    return max(1, min(MAX_ITEMS_PER_JOB, math.ceil(n_items / (2 * max(1, workers or 1)))))


def parse_verdicts(stdout: str, case_counts: Sequence[int]) -> list[dict]:
    """Per item of a job: {"passed": [bool per case], "setup_error": str | None, "started",
    "done"}. A case passes only with exactly one line for it, saying pass."""
    out = [{"lines": [[] for _ in range(n)], "setup_error": None, "started": False,
            "done": False} for n in case_counts]
    for line in stdout.splitlines():
        m = _LINE_RE.fullmatch(line)
        if not m:
            continue
        if m.group(5):
            i = int(m.group(6))
            if i < len(out):
                out[i]["started" if m.group(5) == "start" else "done"] = True
            continue
        i, c = int(m.group(1)), int(m.group(2))
        if i >= len(out):
            continue
        if c < 0:  # -1: the test's setup failed; -2: the sandbox could not start Python
            out[i]["setup_error"] = m.group(4)
        elif c < case_counts[i]:
            out[i]["lines"][c].append(m.group(3))
    for r in out:
        r["passed"] = [v == ["pass"] for v in r.pop("lines")]
    return out
