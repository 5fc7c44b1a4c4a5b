"""Final-answer extraction and equivalence checks for the `math_answer` reward.

`extract_answer` takes the last `\\boxed{...}` (or `\\fbox{...}`) of a completion, else its last
number. `answers_equivalent` compares a predicted and a gold answer:

  1. normalised strings equal (LaTeX wrappers, `$`, spaces, `\\%`, units in `\\text{}` dropped);
  2. both are plain numbers (integers, decimals, `a/b`, `\\frac{a}{b}`): exact rational equality;
  3. otherwise both are parsed by sympy from a whitelisted grammar (digits, single-letter
     variables, + - * / ^ ( ) , and a few named functions/constants) and compared symbolically,
     numerically (relative tolerance 1e-6) when a float is involved.

sympy's parser evaluates Python code, so input that is not in the whitelist is never handed to it,
and every check runs in a killable worker (`jaxrl.rewards.workers`) under a deadline and a memory
limit: `9^9^9` or a pathological `simplify` costs one worker, not the run. Answers longer than
`max_answer_chars` score 0 without being parsed.

The optional `math_verify` backend (`pip install math-verify`) is imported lazily inside the worker.
"""

from __future__ import annotations

import re
from fractions import Fraction

BACKENDS = ("sympy", "math_verify", "auto")
MAX_ANSWER_CHARS = 256
_MAX_NUMBER_DIGITS = 200  # exact Fraction parsing of longer numbers is left to the deadline path
_REL_TOL = 1e-6

_BOXED_RE = re.compile(r"\\(?:boxed|fbox)\s*\{")
_BOXED_SPACE_RE = re.compile(r"\\boxed +([^\s$]+)")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")


def _balanced(text: str, start: int) -> str | None:
    """Contents of the brace group whose `{` is at text[start - 1]; None if unbalanced."""
    depth = 1
    for i in range(start, len(text)):
        c = text[i]
        if c == "{":
            depth += 1
        elif c == "}":
            depth -= 1
            if depth == 0:
                return text[start:i]
    return None


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}` content of `text`, else its last number, else None."""
    last = None
    for m in _BOXED_RE.finditer(text):
        inner = _balanced(text, m.end())
        if inner is not None:
            last = (m.start(), inner)
    spaced = None
    for m in _BOXED_SPACE_RE.finditer(text):
        spaced = (m.start(), m.group(1))
    if spaced is not None and (last is None or spaced[0] > last[0]):
        last = spaced
    if last is not None:
        return last[1].strip()
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return numbers[-1].rstrip(",").strip()
    return None


# --- normalisation -------------------------------------------------------------------------------

_DROP = (r"\left", r"\right", r"\!", r"\,", r"\;", r"\:", r"\ ", "$", r"\displaystyle", r"\mathrm")
_TEXT_RE = re.compile(r"\\(?:text|textbf|mbox|operatorname)\s*\{([^{}]*)\}")
_FRAC_RE = re.compile(r"\\[dt]?frac\s*")
_SQRT_N_RE = re.compile(r"\\sqrt\s*\[([^\[\]]*)\]\s*")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_UNIT_WORDS = re.compile(r"(?<=\d)\s*(?:degrees?|cm|m|km|kg|g|s|units?|dollars?|cents?)$")


def normalize(ans: str) -> str:
    """Canonical string form: wrappers, spacing, `\\%`, degree marks and trailing units removed."""
    s = ans.strip()
    for token in _DROP:
        s = s.replace(token, "")
    s = s.replace(r"\%", "").replace("%", "").replace("^\\circ", "").replace("^{\\circ}", "")
    s = s.replace(r"\dfrac", r"\frac").replace(r"\tfrac", r"\frac")
    # \text{cm} after a number is a unit; \text{...} alone is its content.
    s = _TEXT_RE.sub(lambda m: " " + m.group(1) + " ", s)
    s = " ".join(s.split())
    s = _UNIT_WORDS.sub("", s).strip()
    s = s.rstrip(".").strip()
    if "=" in s:  # "x = 5" -> "5"
        lhs, rhs = s.rsplit("=", 1)
        if re.fullmatch(r"\s*[A-Za-z]\s*", lhs):
            s = rhs.strip()
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    return s.replace(" ", "")


def _as_fraction(s: str) -> Fraction | None:
    """Exact value of an integer, decimal, `a/b` or `\\frac{a}{b}`; None for anything else."""
    m = re.fullmatch(r"\\frac\{(-?[\d.]+)\}\{(-?[\d.]+)\}", s) or re.fullmatch(
        r"(-?[\d.]+)/(-?[\d.]+)", s
    )
    parts = [m.group(1), m.group(2)] if m else [s]
    if any(
        len(p) > _MAX_NUMBER_DIGITS or not re.fullmatch(r"-?(\d+\.?\d*|\.\d+)", p) for p in parts
    ):
        return None
    values = [Fraction(p) for p in parts]
    if len(values) == 2:
        return None if values[1] == 0 else values[0] / values[1]
    return values[0]


def latex_to_expr(s: str) -> str:
    """Rewrites the small LaTeX subset answers use into sympy-parsable infix text."""
    s = _FRAC_RE.sub(r"\\frac", s)
    for _ in range(20):  # nested \frac{\frac{a}{b}}{c}: innermost first
        new = re.sub(r"\\frac\{([^{}]*)\}\{([^{}]*)\}", r"((\1)/(\2))", s)
        new = re.sub(r"\\frac(\d)(\d)", r"((\1)/(\2))", new)
        new = _SQRT_N_RE.sub(lambda m: f"\\root{{{m.group(1)}}}", new)
        new = re.sub(r"\\root\{([^{}]*)\}\{([^{}]*)\}", r"((\2)**(1/(\1)))", new)
        new = re.sub(r"\\sqrt\{([^{}]*)\}", r"sqrt(\1)", new)
        new = re.sub(r"\\sqrt(\d+|[a-zA-Z])", r"sqrt(\1)", new)
        if new == s:
            break
        s = new
    for a, b in (
        (r"\cdot", "*"),
        (r"\times", "*"),
        (r"\div", "/"),
        (r"\pi", "pi"),
        (r"\infty", "oo"),
        (r"\ln", "log"),
        (r"\log", "log"),
        (r"\exp", "exp"),
        (r"\sin", "sin"),
        (r"\cos", "cos"),
        (r"\tan", "tan"),
        ("^", "**"),
        ("{", "("),
        ("}", ")"),
    ):
        s = s.replace(a, b)
    return s


# --- sympy ---------------------------------------------------------------------------------------

_FUNCS = ("sqrt", "log", "exp", "sin", "cos", "tan", "pi", "oo")
_SAFE_CHARS_RE = re.compile(r"[0-9A-Za-z+\-*/().,\s]*")
_IDENT_RE = re.compile(r"[A-Za-z]+")


def _parse_sympy(expr: str):
    """Parses whitelisted infix text with sympy; None if it is outside the whitelist or invalid."""
    if not _SAFE_CHARS_RE.fullmatch(expr):
        return None
    for ident in _IDENT_RE.findall(expr):
        if len(ident) > 1 and ident not in _FUNCS:
            return None
    import sympy
    from sympy.parsing.sympy_parser import (
        convert_xor,
        implicit_multiplication,
        parse_expr,
        standard_transformations,
    )

    names = {c: sympy.Symbol(c) for c in "abcdfghjklmnopqrstuvwxyzABCDFGHJKLMNOPQRSTUVWXYZ"}
    names.update(e=sympy.E, E=sympy.E, i=sympy.I, I=sympy.I)
    for f in _FUNCS:
        names[f] = getattr(sympy, f)
    global_dict = {
        "__builtins__": {},
        "Integer": sympy.Integer,
        "Float": sympy.Float,
        "Rational": sympy.Rational,
        "Symbol": sympy.Symbol,
        "Function": sympy.Function,
    }
    try:
        return parse_expr(
            expr,
            local_dict=names,
            global_dict=global_dict,
            transformations=standard_transformations + (implicit_multiplication, convert_xor),
        )
    except Exception:
        return None


def _sympy_equal(a, b) -> bool:
    import sympy

    if isinstance(a, tuple | sympy.Tuple) or isinstance(b, tuple | sympy.Tuple):
        ta = tuple(a) if isinstance(a, tuple | sympy.Tuple) else (a,)
        tb = tuple(b) if isinstance(b, tuple | sympy.Tuple) else (b,)
        return len(ta) == len(tb) and all(_sympy_equal(x, y) for x, y in zip(ta, tb, strict=True))
    if not (isinstance(a, sympy.Expr) and isinstance(b, sympy.Expr)):
        return a == b
    if a.has(sympy.Float) or b.has(sympy.Float):
        if a.free_symbols or b.free_symbols:
            return sympy.simplify(a - b) == 0
        va, vb = complex(sympy.N(a, 30)), complex(sympy.N(b, 30))
        return abs(va - vb) <= _REL_TOL * max(abs(va), abs(vb), 1e-12)
    diff = sympy.simplify(a - b)
    return diff == 0


def answers_equivalent(pred: str, gold: str, *, max_answer_chars: int = MAX_ANSWER_CHARS) -> bool:
    """True if `pred` and `gold` denote the same value. Slow inputs must run under a deadline."""
    if pred is None or len(pred) > max_answer_chars:
        return False
    a, b = normalize(pred), normalize(str(gold))
    if not a:
        return False
    if a == b:
        return True
    fa, fb = _as_fraction(a), _as_fraction(b)
    if fa is not None and fb is not None:
        return fa == fb
    ea, eb = _parse_sympy(latex_to_expr(a)), _parse_sympy(latex_to_expr(b))
    if ea is None or eb is None:
        return False
    return bool(_sympy_equal(ea, eb))


def math_score(
    completion: str,
    answer: str,
    *,
    backend: str = "sympy",
    max_answer_chars: int = MAX_ANSWER_CHARS,
) -> float:
    """1.0 if the completion's final answer equals `answer`, else 0.0. Runs inside a worker."""
    if backend not in BACKENDS:
        raise ValueError(f"math backend must be one of {BACKENDS}, got {backend!r}")
    if backend in ("math_verify", "auto"):
        try:
            import math_verify
        except ImportError:
            if backend == "math_verify":
                raise ImportError(
                    "math backend 'math_verify' needs the math-verify package "
                    "(pip install math-verify); or use backend='sympy'"
                ) from None
        else:
            gold = math_verify.parse(f"${answer}$", parsing_timeout=None)
            pred = math_verify.parse(completion, parsing_timeout=None)
            return float(bool(math_verify.verify(gold, pred, timeout_seconds=None)))
    pred = extract_answer(completion)
    if pred is None:
        return 0.0
    return float(answers_equivalent(pred, answer, max_answer_chars=max_answer_chars))
