"""Final-answer equivalence for the `math_answer` reward.

    math_score(completion, gold)  ->  1.0 if the completion's final answer equals `gold`, else 0.0

The final answer is the last `\\boxed{...}` of the completion, else the text after a GSM8K `####`,
else its last number (`latex.extract_answer`). Backends:

  * "sympy" (hand-written): both answers are normalised (`latex.normalize`: wrappers, spacing,
    units and `%` as configured), equal strings match; otherwise both are parsed by the bounded
    parser of `parse` (LaTeX fractions, roots, powers, `\\pi`, `i`, functions, tuples,
    intervals, sets, `\\pm`, matrices) into sympy values and compared by `values_equal`: exact
    numbers exactly, a decimal on either side within `rel_tol`, expressions with variables at random
    points, tuples and intervals in order (brackets must agree), sets and bare lists as multisets.
    Infinities compare by identity only (`\\infty` equals `\\infty`, nothing finite); NaN, `1/0`,
    `\\infty + 0.5i` and overflowing powers are refused by the parser, so never equal anything; a
    complex value never equals a real gold. No text is ever handed to sympy's string parser.
  * "math_verify": Hugging Face's `math-verify` package (`pip install math-verify`, or the `math`
    extra) on the whole completion (its own extraction), with a finiteness guard on its parse.
  * "auto" (default): "sympy"; where an answer is outside that grammar (not past a limit: those
    score 0) and math-verify is installed, math-verify's verdict. Measured on one hand-labelled set
    (docs/benchmarks.md), this beats either alone and costs ~1-5 ms a check (math-verify ~70 ms).

Every check runs in a killable worker (`jaxrl.sandbox.workers`) under the reward's deadline and the
worker's memory limit; the parser's size limits (`MAX_ANSWER_CHARS`, `parse.MAX_DIGITS`, ...)
keep ordinary hostile answers far below both.

Modules: `latex` (extraction, normalisation), `parse` (the parser), this one (comparison,
backends, options).
"""

from __future__ import annotations

import logging
import random

from jaxrl.rewards.math.latex import PERCENT_CHOICES, UNITS_CHOICES, extract_answer, normalize
from jaxrl.rewards.math.parse import Bag, Parsed, Refused, Seq, Unparsable, parse_answer

__all__ = [
    "BACKENDS",
    "MAX_ANSWER_CHARS",
    "answers_equivalent",
    "verdict",
    "check_options",
    "extract_answer",
    "math_score",
    "normalize",
    "values_equal",
]

BACKENDS = ("sympy", "math_verify", "auto")
MAX_ANSWER_CHARS = 256
REL_TOL = 1e-6
_EXACT_TOL = 1e-30  # irrational exact values: compared at 50 digits
_POINTS = 3  # random points for expressions with variables
_MAX_ITEMS = 64  # entries of a set/tuple (multiset matching is quadratic)


def check_options(
    backend: str = "auto",
    units: str = "strip",
    percent: str = "strip",
    rel_tol: float = REL_TOL,
    max_answer_chars: int = MAX_ANSWER_CHARS,
) -> None:
    """Raises ValueError naming the bad option value and the valid ones."""
    for name, value, choices in (
        ("backend", backend, BACKENDS),
        ("units", units, UNITS_CHOICES),
        ("percent", percent, PERCENT_CHOICES),
    ):
        if value not in choices:
            raise ValueError(f"math_answer {name} must be one of {choices}, got {value!r}")
    if isinstance(rel_tol, bool) or not isinstance(rel_tol, int | float) or not 0 <= rel_tol < 1:
        raise ValueError(f"math_answer rel_tol must be a number in [0, 1), got {rel_tol!r}")
    if isinstance(max_answer_chars, bool) or not isinstance(max_answer_chars, int):
        raise ValueError(f"math_answer max_answer_chars must be an int, got {max_answer_chars!r}")
    if max_answer_chars < 1:
        raise ValueError(f"math_answer max_answer_chars must be >= 1, got {max_answer_chars!r}")


# --- comparison ----------------------------------------------------------------------------------


def _abs(x, sp, prec: int = 50):
    """|x| of a constant expression as a sympy Float (any exponent); None if not a finite number."""
    try:
        re_, im_ = sp.N(x, prec).as_real_imag()
        re_, im_ = sp.N(re_, prec), sp.N(im_, prec)
    except (TypeError, ValueError, OverflowError, AttributeError):
        return None
    if not (re_.is_Number and im_.is_Number) or re_.has(sp.oo, -sp.oo, sp.nan, sp.zoo):
        return None
    if im_.has(sp.oo, -sp.oo, sp.nan, sp.zoo):
        return None
    return sp.sqrt(re_**2 + im_**2).evalf(prec)


def _close(a, b, tol: float, sp) -> bool:
    """|a - b| <= tol * max(|a|, |b|, 1e-12), evaluated at 50 digits (no float overflow); with
    `tol` 0 (exact answers) a difference sympy reduces to a rational must be 0."""
    diff = a - b
    if tol == 0:
        if diff.is_Rational:
            return diff == 0
        tol = _EXACT_TOL
    d, va, vb = _abs(diff, sp), _abs(a, sp), _abs(b, sp)
    if d is None or va is None or vb is None:
        return False
    return bool(d <= sp.Float(tol) * max(va, vb, sp.Float(1e-12)))


def _expr_equal(a, b, tol: float, sp) -> bool:
    infinite = (sp.oo, -sp.oo)
    if a in infinite or b in infinite:  # identity only: never a tolerance with an infinity
        return a == b
    if a.has(sp.I) != b.has(sp.I) and not (a.free_symbols or b.free_symbols):
        # A complex value never equals a real one: the side with an `i` must be exactly real.
        if sp.im(a if a.has(sp.I) else b) != 0:
            return False
    if a == b:
        return True
    symbols = sorted(a.free_symbols | b.free_symbols, key=str)
    if not symbols:
        return _close(a, b, tol, sp)
    # Variables: equal at random points (an identity holds at every point; a false one almost
    # never). The points are fresh for every check, so they cannot be learnt.
    rng = random.Random()
    for _ in range(_POINTS):
        point = {s: sp.Rational(rng.randint(1000, 3000), 1000) for s in symbols}
        if not _close(a.xreplace(point), b.xreplace(point), tol, sp):
            return False
    return True


def _multiset_equal(xs: tuple, ys: tuple, eq) -> bool:
    if len(xs) != len(ys):
        return False
    left = list(ys)
    for x in xs:
        for k, y in enumerate(left):
            if eq(x, y):
                del left[k]
                break
        else:
            return False
    return True


def values_equal(a, b, tol: float, sp=None) -> bool:
    """Equality of two parsed values (see the module docstring); `tol` 0 means exact."""
    if sp is None:
        import sympy as sp
    if isinstance(a, Seq) or isinstance(b, Seq):
        if not (isinstance(a, Seq) and isinstance(b, Seq)):
            return False
        if (a.open, a.close) != (b.open, b.close) or len(a.items) != len(b.items):
            return False
        return all(values_equal(x, y, tol, sp) for x, y in zip(a.items, b.items, strict=True))
    if isinstance(a, Bag) or isinstance(b, Bag):
        if not (isinstance(a, Bag) and isinstance(b, Bag)) or len(a.items) > _MAX_ITEMS:
            return False
        return _multiset_equal(a.items, b.items, lambda x, y: values_equal(x, y, tol, sp))
    return _expr_equal(a, b, tol, sp)


def _parse(s: str) -> Parsed | str:
    """The parsed value, or "grammar" (outside the grammar) or "refused" (past a limit)."""
    try:
        return parse_answer(s)
    except Refused:
        return "refused"
    except (RecursionError, OverflowError, MemoryError):
        return "refused"
    except (Unparsable, ValueError, TypeError, ZeroDivisionError):
        return "grammar"


def verdict(
    pred: str | None,
    gold: str,
    *,
    max_answer_chars: int = MAX_ANSWER_CHARS,
    units: str = "strip",
    percent: str = "strip",
    rel_tol: float = REL_TOL,
) -> bool | None:
    """The hand-written checker's verdict; None if an answer is outside its grammar (not past a
    limit) and the two normalised strings differ, i.e. it cannot tell."""
    if pred is None or len(pred) > max_answer_chars:
        return False
    a = normalize(pred, units=units, percent=percent)
    b = normalize(str(gold), units=units, percent=percent)
    if not a:
        return False
    pa, pb = _parse(a), _parse(b)
    if "refused" in (pa, pb):
        return False
    if isinstance(pa, str) or isinstance(pb, str):
        # Text answers ("Monday", "(C)") and anything outside the grammar: string equality only.
        if isinstance(pa, str) and isinstance(pb, str) and a.lower() == b.lower():
            return True
        return None
    tol = rel_tol if (pa.inexact or pb.inexact) else 0.0
    return values_equal(pa.value, pb.value, tol)


def answers_equivalent(pred: str | None, gold: str, **options) -> bool:
    """True if the answer strings `pred` and `gold` denote the same value (hand-written backend;
    options as `verdict`)."""
    return bool(verdict(pred, gold, **options))


# --- math-verify ---------------------------------------------------------------------------------


def _finite_sympy(x) -> bool:
    import sympy

    if isinstance(x, str):
        return True
    if isinstance(x, sympy.Basic):
        if x.has(sympy.zoo, sympy.nan):
            return False
        if x.has(sympy.oo, -sympy.oo) and x not in (sympy.oo, -sympy.oo):
            return isinstance(x, sympy.Interval | sympy.Union | sympy.FiniteSet | sympy.Tuple)
        return True
    return True


def _math_verify_score(completion: str, gold: str) -> float:
    try:
        import math_verify
    except ImportError:
        raise ImportError(
            "math_answer backend 'math_verify' needs the math-verify package "
            "(pip install math-verify); or use backend='sympy'"
        ) from None
    # The worker's deadline bounds the call; math-verify's own SIGALRM timeouts are turned off
    # (and its warning that they are, logged on every call, silenced).
    logging.getLogger("math_verify").setLevel(logging.ERROR)
    # The library's own extraction reads the completion (last boxed answer, else last expression).
    g = math_verify.parse(f"${gold}$", parsing_timeout=None)
    p = math_verify.parse(completion, parsing_timeout=None)
    if not p or not g or not all(_finite_sympy(x) for x in p[:1]):
        return 0.0
    return float(bool(math_verify.verify(g, p, timeout_seconds=None)))


def _has_math_verify() -> bool:
    try:
        import math_verify  # noqa: F401
    except ImportError:
        return False
    return True


def math_score(
    completion: str,
    answer: str,
    *,
    backend: str = "auto",
    max_answer_chars: int = MAX_ANSWER_CHARS,
    units: str = "strip",
    percent: str = "strip",
    rel_tol: float = REL_TOL,
) -> float:
    """1.0 if the completion's final answer equals `answer`, else 0.0. Runs inside a worker."""
    check_options(backend, units, percent, rel_tol, max_answer_chars)
    pred = extract_answer(completion)
    if pred is None or len(pred) > max_answer_chars:
        return 0.0
    if backend == "math_verify":
        return _math_verify_score(completion, answer)
    v = verdict(
        pred,
        answer,
        max_answer_chars=max_answer_chars,
        units=units,
        percent=percent,
        rel_tol=rel_tol,
    )
    if v is None and backend == "auto" and _has_math_verify():
        return _math_verify_score(completion, answer)  # outside the hand-written grammar
    return float(bool(v))
