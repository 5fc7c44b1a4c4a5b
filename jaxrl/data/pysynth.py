"""`pysynth`: program synthesis from input/output examples, verified by running code in the sandbox.

A problem is an integer function f built from a small grammar (x, constants, + - *), shown by a few
examples; the model writes f as a Python expression in x (or a `def f(x): ...` function). Every
such f is an integer polynomial; the reference (the SFT demonstration) is its canonical form,
highest degree first ("2*x*x-x+3"), so demonstrations are consistent across equal functions:

    prompt      "f(1)=3 f(4)=9 f(7)=15\\nf(x)="      completion "2*x+1" <eos>

The reward runs the candidate on hidden inputs in the sandbox pool and compares the values with the
reference function's on the trusted side (expected values never enter the sandbox). Any program
that agrees on every hidden input earns 1.0 (`x*2+1`, `x+x+1`, `def f(x): return 2*x+1`), not only
the generating expression.

Throughput: candidates whose expression passes a small syntax whitelist (integers, x, + - * // %
and ** by a constant <= 4, not nested) cannot reach names, attributes or calls, so many share ONE
sandbox job (chunks of `exprs_per_job`); each candidate is evaluated in its own try/except, so one
raising candidate costs only itself. Anything else that parses (a function, another expression)
runs in a job of its own. Text that does not parse scores 0 without reaching the sandbox.

Split: a function's values on fixed probe inputs are hashed; one hash bucket in 8 is the eval
split, so held-out problems use functions never seen in training (equal functions written
differently land in the same split). Depth 1 (levels 0 and 1) has only 12-36 functions, so there
the split is by problem (function + shown inputs) instead: held-out prompts are new, their
functions are not.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import hashlib
import random
import re
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from jaxrl.rewards.code.tests import (
    TestCase,
    code_tests_batch,
    extract_code,
    harness_source,
    parse_harness_output,
    values_equal,
)
from jaxrl.rewards.rewards import register_reward
from jaxrl.sandbox.types import SandboxJob

# difficulty level -> (depth, const_max, examples); DataConfig.pysynth_* override single knobs.
LEVELS: dict[int, tuple[int, int, int]] = {0: (1, 3, 4), 1: (1, 9, 4), 2: (2, 5, 4), 3: (3, 9, 3)}
SHOWN_X = range(0, 10)  # shown example inputs
HIDDEN_X = range(-10, 21)  # hidden test inputs
PROBE_X = tuple(range(-4, 9))  # fingerprint inputs (split + equality of functions)
EVAL_BUCKETS = 8
MAX_ABS_SHOWN = 999  # keeps prompts short
MAX_REF_CHARS = 16
MAX_CANDIDATE_CHARS = 200


@dataclasses.dataclass(frozen=True)
class PySynthSpec:
    depth: int = 2
    const_max: int = 5
    examples: int = 4
    hidden_tests: int = 8

    def __post_init__(self):
        if not 1 <= self.depth <= 4 or not 1 <= self.const_max <= 99:
            raise ValueError(f"pysynth depth in 1..4 and const_max in 1..99; got {self}")
        if not 1 <= self.examples <= len(SHOWN_X) or not 1 <= self.hidden_tests <= len(HIDDEN_X):
            raise ValueError(f"pysynth examples in 1..{len(SHOWN_X)}, hidden_tests in "
                             f"1..{len(HIDDEN_X)}; got {self}")

    @classmethod
    def from_level(cls, level: int, **overrides) -> PySynthSpec:
        if level not in LEVELS:
            raise ValueError(f"pysynth difficulty {level!r} is not valid; levels: {sorted(LEVELS)}")
        depth, const_max, examples = LEVELS[level]
        base = dict(depth=depth, const_max=const_max, examples=examples)
        base.update({k: v for k, v in overrides.items() if v is not None})
        return cls(**base)


# --- expression trees: ("x",) | ("c", int) | (op, left, right) -------------------------------

_PREC = {"+": 1, "-": 1, "*": 2}


def to_source(node) -> str:
    """Compact Python source with the fewest parentheses (e.g. "2*(x+1)-x")."""
    return _src(node)[0]


def _src(node) -> tuple[str, int]:
    if node[0] == "x":
        return "x", 3
    if node[0] == "c":
        return str(node[1]), 3
    op, left, right = node
    p = _PREC[op]
    ls, lp = _src(left)
    rs, rp = _src(right)
    if lp < p:
        ls = f"({ls})"
    if rp < p or (rp == p and op == "-"):
        rs = f"({rs})"
    return f"{ls}{op}{rs}", p


def evaluate(node, x: int) -> int:
    if node[0] == "x":
        return x
    if node[0] == "c":
        return node[1]
    a, b = evaluate(node[1], x), evaluate(node[2], x)
    return a + b if node[0] == "+" else a - b if node[0] == "-" else a * b


def polynomial(node) -> dict[int, int]:
    """The tree as an integer polynomial {degree: coefficient} (zero terms dropped)."""
    if node[0] == "x":
        return {1: 1}
    if node[0] == "c":
        return {0: node[1]} if node[1] else {}
    a, b = polynomial(node[1]), polynomial(node[2])
    out: dict[int, int] = {}
    if node[0] == "*":
        for da, ca in a.items():
            for db, cb in b.items():
                out[da + db] = out.get(da + db, 0) + ca * cb
    else:
        sign = 1 if node[0] == "+" else -1
        out = dict(a)
        for d, c in b.items():
            out[d] = out.get(d, 0) + sign * c
    return {d: c for d, c in out.items() if c}


def canonical(poly: Mapping[int, int]) -> str:
    """Shortest-habit source of a polynomial, highest degree first: "2*x*x-x+3", "x**3+1"."""
    parts = []
    for d in sorted(poly, reverse=True):
        c = poly[d]
        mono = "" if d == 0 else "x" if d == 1 else "x*x" if d == 2 else f"x**{d}"
        mag = abs(c)
        body = str(mag) if d == 0 else mono if mag == 1 else f"{mag}*{mono}"
        parts.append(("-" if c < 0 else "+" if parts else "") + body)
    return "".join(parts) or "0"


def _random_tree(rng: random.Random, depth: int, const_max: int, root: bool = True):
    if depth == 0 or (not root and rng.random() < 0.35):
        return ("x",) if rng.random() < 0.55 else ("c", rng.randint(1, const_max))
    op = rng.choice("+-*")
    return (op, _random_tree(rng, depth - 1, const_max, False),
            _random_tree(rng, depth - 1, const_max, False))


def _degenerate(node) -> bool:
    """Sub-trees a person would simplify: const op const, *1, e - e."""
    if node[0] in ("x", "c"):
        return False
    op, left, right = node
    if left[0] == "c" and right[0] == "c":
        return True
    if op == "*" and (left == ("c", 1) or right == ("c", 1)):
        return True
    if op == "-" and left == right:
        return True
    return _degenerate(left) or _degenerate(right)


def fingerprint(fn) -> tuple[int, ...]:
    return tuple(fn(x) for x in PROBE_X)


def split_of(key) -> str:
    """"eval" for one hash bucket in EVAL_BUCKETS of `key`, else "train"."""
    digest = hashlib.sha256(repr(key).encode()).digest()
    return "eval" if digest[0] % EVAL_BUCKETS == 0 else "train"


def make_problem(spec: PySynthSpec, split: str, index: int, seed: int) -> dict:
    """Problem `index` of `split`: a pure function of (spec, split, index, seed)."""
    rng = random.Random(f"pysynth:{seed}:{split}:{index}:{spec}")
    for _ in range(10_000):
        tree = _random_tree(rng, spec.depth, spec.const_max)
        ref = canonical(polynomial(tree))
        if "x" not in ref or len(ref) > MAX_REF_CHARS or _degenerate(tree):
            continue
        values = fingerprint(functools.partial(evaluate, tree))
        if len(set(values)) == 1:
            continue
        shown = sorted(rng.sample(SHOWN_X, spec.examples))
        # depth 1 has too few functions to hold some out: split those problems by instance.
        if split_of(values if spec.depth > 1 else (values, shown)) != split:
            continue
        outs = [evaluate(tree, x) for x in shown]
        if max(abs(v) for v in outs) > MAX_ABS_SHOWN:
            continue
        hidden = sorted(rng.sample(HIDDEN_X, spec.hidden_tests))
        prompt = " ".join(f"f({x})={y}" for x, y in zip(shown, outs, strict=True)) + "\nf(x)="
        return {
            "uid": f"pysynth:{split}:{index}",
            "prompt": prompt,
            "reference": ref,
            "inputs": hidden,
            "expected": [evaluate(tree, x) for x in hidden],
        }
    raise RuntimeError(f"pysynth: no {split} problem found for {spec} (grammar too small?)")


def chat_prompt(record: Mapping[str, Any]) -> str:
    examples = record["prompt"].split("\n")[0].replace(" ", ", ")
    return (f"Find the integer function f with {examples}. Reply with one line "
            "`f(x)=<Python expression in x>`.")


def demonstration(record: Mapping[str, Any], chat: bool = False) -> str:
    return f"f(x)={record['reference']}" if chat else record["reference"]


# --- candidates ------------------------------------------------------------------------------

_SAFE_BINOPS = (ast.Add, ast.Sub, ast.Mult, ast.FloorDiv, ast.Mod, ast.Pow)
_PREFIX_RE = re.compile(r"^\s*(?:f\s*\(\s*x\s*\)\s*=|lambda\s+x\s*:|return\b)\s*")


def _safe(node: ast.AST) -> bool:
    if isinstance(node, ast.Expression):
        return _safe(node.body)
    if isinstance(node, ast.Name):
        return node.id == "x"
    if isinstance(node, ast.Constant):
        return type(node.value) is int and abs(node.value) < 10**6
    if isinstance(node, ast.UnaryOp):
        return isinstance(node.op, ast.USub | ast.UAdd) and _safe(node.operand)
    if isinstance(node, ast.BinOp) and isinstance(node.op, _SAFE_BINOPS):
        if isinstance(node.op, ast.Pow):
            r = node.right
            if not (isinstance(r, ast.Constant) and type(r.value) is int and 0 <= r.value <= 4):
                return False
            if any(isinstance(n, ast.BinOp) and isinstance(n.op, ast.Pow)
                   for n in ast.walk(node.left)):
                return False  # no towers: values stay polynomial in x
        return _safe(node.left) and _safe(node.right)
    return False


def parse_candidate(completion: str) -> tuple[str, str]:
    """(kind, code): kind "expr" (whitelisted expression), "program" (defines f) or "invalid"."""
    text = extract_code(completion)
    if len(text) > 20 * MAX_CANDIDATE_CHARS:
        return "invalid", ""
    if re.search(r"^\s*def\s+f\s*\(", text, re.MULTILINE):
        try:
            ast.parse(text)
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return "invalid", ""
        return "program", text
    lines = [ln for ln in text.strip().splitlines() if ln.strip()]
    if not lines:
        return "invalid", ""
    marked = [ln for ln in lines if _PREFIX_RE.match(ln)]
    expr = _PREFIX_RE.sub("", (marked or lines)[-1 if marked else 0]).strip().rstrip(".;")
    if not expr or len(expr) > MAX_CANDIDATE_CHARS:
        return "invalid", ""
    try:
        tree = ast.parse(expr, mode="eval")
    except (SyntaxError, ValueError, MemoryError, RecursionError):
        return "invalid", ""
    if _safe(tree):
        return "expr", expr
    return "program", f"def f(x):\n    return ({expr})\n"


def _harness_job(code: str, cases: list[TestCase], timeout_s: float, memory_mb: int):
    nonce = secrets.token_hex(16)
    job = SandboxJob(code=harness_source(code, cases, nonce), timeout_s=timeout_s,
                     memory_mb=memory_mb)
    return job, nonce


def _expr_job(chunk, items, timeout_s, memory_mb):
    """One job evaluating whitelisted expressions `chunk` = [(item index, source)], each case in
    its own try (the harness's), so a raising candidate costs only its own cases."""
    code = "\n".join(f"_c{j} = lambda x: ({src})" for j, (_, src) in enumerate(chunk))
    cases, ids = [], []
    for j, (k, _) in enumerate(chunk):
        for x in items[k]["inputs"]:
            cases.append(TestCase("expr", None, expr=f"_c{j}({int(x)})"))
            ids.append(k)
    job, nonce = _harness_job(code, cases, timeout_s, memory_mb)
    return job, (nonce, ids, cases)


def _run(pool, jobs, plan, entries):
    results = pool.run(jobs)
    if len(results) != len(jobs):
        raise RuntimeError(f"pool returned {len(results)} results for {len(jobs)} jobs")
    for (nonce, ids, cases), res in zip(plan, results, strict=True):
        for k, e in zip(ids, parse_harness_output(res.stdout, nonce, len(cases)), strict=True):
            entries.setdefault(k, []).append(e)
    return results


def pysynth_batch(
    items: Sequence[Mapping[str, Any]],
    *,
    pool,
    exprs_per_job: int = 64,
    job_timeout_s: float = 5.0,
    memory_mb: int = 256,
    mode: str = "all",
    workers=None,
    timeout_s: float | None = None,
) -> list[float | Exception]:
    """Scores completions with one `pool.run` call: 1.0 if the candidate agrees with the reference
    on every hidden input (mode="all") or the fraction it agrees on (mode="fraction").

    `job_timeout_s` bounds each sandbox job (a chunk of expressions, or one program). A program
    that runs out of time scores 0. A shared expression job that fails (which whitelisted
    expressions should never cause) is retried once with one job per candidate, so a fault is
    pinned on the candidate that caused it. `workers` / `timeout_s` (the scorer's per-item
    deadline for worker rewards) are accepted and unused: this reward runs in the sandbox pool.
    """
    del workers, timeout_s
    if mode not in ("all", "fraction"):
        raise ValueError(f"pysynth mode must be one of ['all', 'fraction'], got {mode!r}")
    if pool is None:
        raise ValueError("pysynth needs a sandbox pool: pass pool=LocalSandboxPool(...)")
    out: list[float | Exception] = [0.0] * len(items)
    exprs: list[tuple[int, str]] = []
    jobs: list[SandboxJob] = []
    plan: list[tuple[str, list[int], list[TestCase]]] = []  # (nonce, item ids, cases) per job
    for k, item in enumerate(items):
        if "inputs" not in item or "expected" not in item:
            out[k] = ValueError(f"pysynth item needs 'inputs' and 'expected'; has {sorted(item)}")
            continue
        kind, code = parse_candidate(str(item.get("completion", "")))
        if kind == "expr":
            exprs.append((k, code))
        elif kind == "program":
            cases = [TestCase("call", None, fn="f", args=(x,)) for x in item["inputs"]]
            job, nonce = _harness_job(code, cases, job_timeout_s, memory_mb)
            jobs.append(job)
            plan.append((nonce, [k] * len(cases), cases))
    n_own = len(jobs)
    chunks = [exprs[i:i + exprs_per_job] for i in range(0, len(exprs), exprs_per_job)]
    for chunk in chunks:
        job, p = _expr_job(chunk, items, job_timeout_s, memory_mb)
        jobs.append(job)
        plan.append(p)
    if not jobs:
        return out
    entries: dict[int, list] = {}
    results = _run(pool, jobs, plan, entries)
    retry = [pair for chunk, res in zip(chunks, results[n_own:], strict=True)
             if res.status != "ok" and len(chunk) > 1
             for pair in chunk if None in entries[pair[0]]]
    if retry:
        for k, _ in retry:
            del entries[k]
        jobs, plan = zip(*(_expr_job([pair], items, job_timeout_s, memory_mb) for pair in retry),
                         strict=True)
        _run(pool, list(jobs), list(plan), entries)
    for k, got in entries.items():
        expected = items[k]["expected"]
        passed = sum(_passes(e, x) for e, x in zip(got, expected, strict=True))
        out[k] = float(passed == len(expected)) if mode == "all" else passed / len(expected)
    return out


def _passes(entry, expected) -> bool:
    if entry is None or entry[0] != "value" or len(entry[1]) > 10_000:
        return False
    try:
        return values_equal(ast.literal_eval(entry[1]), expected)
    except (ValueError, TypeError, SyntaxError, MemoryError, RecursionError):
        return False


@register_reward("pysynth", batch=pysynth_batch, needs_pool=True, isolated=False)
def pysynth_reward(prompt: str, completion: str, *, inputs, expected, pool=None, **options):
    """1.0 if the completion's f agrees with the reference on every hidden input (sandboxed)."""
    del prompt
    (score,) = pysynth_batch(
        [{"completion": completion, "inputs": inputs, "expected": expected}], pool=pool, **options
    )
    if isinstance(score, Exception):
        raise score
    return score


def pysynth_tests_batch(items: Sequence[Mapping[str, Any]], *, pool, workers=None,
                        timeout_s: float | None = None, **options) -> list[float | Exception]:
    """The fraction of the hidden tests the completion's f passes, judged as `code_tests` judges
    function cases: the candidate only computes values in a process of its own, a judge process
    that never loads its code compares them with the expected values (which never enter the
    candidate's process) and reports each case on a channel the candidate cannot reach. Text
    that does not parse scores 0 without reaching the sandbox. Options: those of
    `code_tests_batch` (mode "fraction" by default; "all" for 0 or 1)."""
    del workers, timeout_s
    out: list[float | Exception] = [0.0] * len(items)
    judged, ids = [], []
    for k, item in enumerate(items):
        if "inputs" not in item or "expected" not in item:
            out[k] = ValueError(f"pysynth item needs 'inputs' and 'expected'; has {sorted(item)}")
            continue
        kind, code = parse_candidate(str(item.get("completion", "")))
        if kind == "invalid":
            continue
        program = f"def f(x):\n    return ({code})\n" if kind == "expr" else code
        tests = [{"fn": "f", "args": [int(x)], "expected": int(y)}
                 for x, y in zip(item["inputs"], item["expected"], strict=True)]
        judged.append({"prompt": "", "completion": program, "tests": tests})
        ids.append(k)
    if judged:
        for k, score in zip(ids, code_tests_batch(judged, pool=pool, **options), strict=True):
            out[k] = score
    return out


@register_reward("pysynth_tests", batch=pysynth_tests_batch, needs_pool=True, isolated=False)
def pysynth_tests_reward(prompt: str, completion: str, *, inputs, expected, pool=None,
                         **options):
    """The fraction of the hidden tests the completion's f passes (judged; see the batch)."""
    del prompt
    (score,) = pysynth_tests_batch(
        [{"completion": completion, "inputs": inputs, "expected": expected}], pool=pool, **options
    )
    if isinstance(score, Exception):
        raise score
    return score
