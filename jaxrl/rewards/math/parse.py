"""A bounded parser for the LaTeX that math answers use, building sympy values directly.

`parse_answer` turns a normalised answer (`latex.normalize`) into values for
`answer.values_equal`:

  * a sympy expression (numbers are exact Rationals; `inexact` records a decimal point, which
    switches the comparison to a relative tolerance);
  * `Seq(open, close, items)`: a bracketed tuple or interval such as `(1, 2)`, `[0, \\infty)` or a
    `pmatrix` (rows are Seqs), ordered;
  * `Bag(items)`: a bare list `1, 2`, a set `\\{1, 2\\}`, a union of intervals, a `\\pm`;
    unordered.

Nothing is ever handed to sympy's string parser (which runs `eval`): the grammar is fractions,
roots, powers, factorials, `\\pi`, `e`, `i`, `\\infty`, a few functions, single-letter variables,
brackets, sets, unions, `\\pm`, `=` and matrices. It raises `Unparsable` for anything outside it,
nesting deeper than `MAX_DEPTH`, powers or factorials whose exact value would exceed `MAX_DIGITS`
digits, and any value that is infinite, undefined or NaN unless it is a bare `\\infty` or
`-\\infty` (an interval end, or an answer of its own). So the exact arithmetic stays small, and a
value such as `\\infty + 0.5i` or `9.0^{9^{9}}` is never produced at all.
"""

from __future__ import annotations

import dataclasses
import math
import re

MAX_DEPTH = 24  # brackets/braces/fractions nested in one answer
MAX_DIGITS = 5000  # decimal digits of any exact power or factorial the parser will build
MAX_ROOT_INDEX = 100
MAX_SYMBOLIC_EXPONENT = 64  # (x+1)^64 is kept; larger integer powers of a symbol are refused


class Unparsable(ValueError):
    """The answer is outside the grammar (it is then compared as a string)."""


class Refused(Unparsable):
    """The answer is inside the grammar but past a limit, or infinite/undefined: never equal."""


# --- the parser ----------------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Seq:
    """An ordered bracketed sequence: `(1, 2)`, `[0, 1)`, a matrix (open "M")."""

    open: str
    close: str
    items: tuple


@dataclasses.dataclass(frozen=True)
class Bag:
    """An unordered collection: `1, 2`, `\\{1, 2\\}`, `A \\cup B`, `1 \\pm 2`."""

    items: tuple


@dataclasses.dataclass
class Parsed:
    value: object
    inexact: bool  # a decimal number occurs: compare with a relative tolerance


_TOKEN_RE = re.compile(
    r"(?P<num>\d+\.?\d*|\.\d+)|(?P<cmd>\\[A-Za-z]+|\\[{}|])|(?P<word>[A-Za-z]+)|"
    r"(?P<op>\\\\|[-+*/^_()\[\]{},=!&|<>])|(?P<space>\s+)"
)
_FUNCS = {
    "sin": "sin",
    "cos": "cos",
    "tan": "tan",
    "cot": "cot",
    "sec": "sec",
    "csc": "csc",
    "arcsin": "asin",
    "arccos": "acos",
    "arctan": "atan",
    "ln": "log",
    "log": "log",
    "exp": "exp",
}
_BARE_FUNCS = {"sqrt", "sin", "cos", "tan", "log", "ln", "exp"}
_MUL_CMDS = {r"\cdot", r"\times", r"\ast"}
_ATOM_CMDS = {r"\frac", r"\sqrt", r"\pi", r"\infty", r"\begin"} | {"\\" + f for f in _FUNCS}


def _tokenize(s: str) -> list[tuple[str, str]]:
    s = s.replace("**", "^")
    out, pos = [], 0
    while pos < len(s):
        m = _TOKEN_RE.match(s, pos)
        if not m:
            raise Unparsable(f"unexpected character {s[pos]!r}")
        pos = m.end()
        kind = m.lastgroup
        if kind == "space":
            continue
        text = m.group()
        if kind == "word" and out[-2:] in (
            [("cmd", r"\begin"), ("op", "{")],
            [("cmd", r"\end"), ("op", "{")],
        ):
            out.append(("env", text))  # \begin{pmatrix}
            continue
        if kind == "word" and text not in _BARE_FUNCS and text != "pi":
            if len(text) > 2:  # a word: not an expression (compared as text)
                raise Unparsable(f"word {text!r}")
            out.extend(("word", c) for c in text)  # "xy": x times y
            continue
        out.append((kind, text))
    return out


class _Parser:
    def __init__(self, tokens, sympy):
        self.toks, self.i, self.sp, self.depth, self.inexact = tokens, 0, sympy, 0, False

    # token helpers
    def peek(self, k: int = 0):
        j = self.i + k
        return self.toks[j] if j < len(self.toks) else ("end", "")

    def take(self):
        tok = self.peek()
        self.i += 1
        return tok

    def expect(self, text: str):
        tok = self.take()
        if tok[1] != text:
            raise Unparsable(f"expected {text!r}, got {tok[1]!r}")

    def enter(self):
        self.depth += 1
        if self.depth > MAX_DEPTH:
            raise Refused(f"nested deeper than {MAX_DEPTH}")

    # grammar: list := union (',' union)* ; union := eq (\cup eq)* ; eq := expr ('=' expr)?
    def parse_list(self, closers: tuple[str, ...]):
        items = [self.parse_union()]
        while self.peek()[1] == ",":
            self.take()
            items.append(self.parse_union())
        if self.peek()[1] not in closers:
            raise Unparsable(f"unexpected {self.peek()[1]!r}")
        return items

    def parse_union(self):
        parts = [self.parse_eq()]
        while self.peek()[1] == r"\cup":
            self.take()
            parts.append(self.parse_eq())
        return parts[0] if len(parts) == 1 else Bag(tuple(parts))

    def parse_eq(self):
        lhs = self.parse_expr()
        if self.peek()[1] != "=":
            return lhs
        self.take()
        rhs = self.parse_expr()
        if isinstance(lhs, self.sp.Symbol):  # "x = 5": the value
            return rhs
        return Seq("=", "=", (lhs, rhs))

    def parse_expr(self):
        self.enter()
        terms = [self.parse_term()]
        pm = []
        while self.peek()[1] in ("+", "-", r"\pm", r"\mp"):
            op = self.take()[1]
            term = self.parse_term()
            if op in (r"\pm", r"\mp"):
                pm.append(term)
            else:
                terms.append(term if op == "+" else self._neg(term))
        self.depth -= 1
        base = self._sum(terms)
        if not pm:
            return base
        if len(pm) > 1:
            raise Unparsable("more than one \\pm")
        return Bag((self._sum([base, pm[0]]), self._sum([base, self._neg(pm[0])])))

    def _neg(self, v):
        self._scalar(v)
        return -v

    def _sum(self, terms):
        if len(terms) > 1:
            for t in terms:
                self._scalar(t)
        return self.sp.Add(*terms) if len(terms) > 1 else terms[0]

    def _scalar(self, v, *, infinite_ok: bool = False):
        """`v` as an operand: a number or expression; +-infinity only under a unary minus (no
        arithmetic with an infinity: sympy calls `\\infty^0` 1 and `0.5\\infty` infinity)."""
        if not isinstance(v, self.sp.Expr):
            raise Unparsable("arithmetic on a tuple or set")
        if not infinite_ok and v.has(self.sp.oo, -self.sp.oo, self.sp.zoo):
            raise Refused("arithmetic with an infinity")
        return v

    def parse_term(self):
        value = self.parse_unary()
        while True:
            kind, text = self.peek()
            if text in _MUL_CMDS or text == "*":
                self.take()
                value = self._scalar(value) * self._scalar(self.parse_unary())
            elif text in ("/", r"\div"):
                self.take()
                value = self._scalar(value) / self._scalar(self.parse_unary())
            elif (kind in ("num", "word") or text in _ATOM_CMDS or text in ("(", "{")) and not (
                kind == "num" and self.peek(-1)[0] == "num"
            ):
                value = self._scalar(value) * self._scalar(self.parse_power())  # implicit: 2x
            else:
                return value

    def parse_unary(self):
        text = self.peek()[1]
        if text in ("-", "+"):
            self.take()
            v = self._scalar(self.parse_unary(), infinite_ok=True)
            return -v if text == "-" else v
        return self.parse_power()

    def parse_power(self):
        base = self.parse_postfix()
        if self.peek()[1] != "^":
            return base
        self.take()
        self.enter()
        exp = self.parse_unary() if self.peek()[1] == "-" else self.parse_power_operand()
        self.depth -= 1
        return self._pow(self._scalar(base), self._scalar(exp))

    def parse_power_operand(self):
        kind, text = self.peek()
        if kind == "num":  # 2^10 read as 2^{10}, as a person means it
            self.take()
            return self._number(text)
        return self.parse_power()

    def parse_postfix(self):
        value = self.parse_atom()
        while self.peek()[1] == "!":
            self.take()
            value = self._factorial(value)
        return value

    def _number(self, text: str):
        if "." in text:
            self.inexact = True
        return self.sp.Rational(text.rstrip(".") or "0")

    def parse_group(self):
        """A `{...}` argument, or a single token (`\\frac12`)."""
        kind, text = self.peek()
        if text == "{":
            self.take()
            self.enter()
            v = self.parse_expr()
            self.expect("}")
            self.depth -= 1
            return v
        if kind == "num":
            self.take()
            if len(text) > 1 and "." not in text:  # \frac12 = \frac{1}{2}
                self.toks.insert(self.i, ("num", text[1:]))
                return self.sp.Integer(text[0])
            return self._number(text)
        return self.parse_atom()

    def parse_atom(self):
        sp = self.sp
        kind, text = self.take()
        if kind == "num":
            return self._number(text)
        if kind == "word":
            if text == "pi":
                return sp.pi
            if text in _BARE_FUNCS:
                return self._apply(text, self.parse_power)
            if text in ("i",):
                return sp.I
            if text == "e":
                return sp.E
            return sp.Symbol(text)
        if text in ("(", "[", r"\{", "{"):
            return self.parse_bracket(text)
        if kind == "cmd":
            return self.parse_command(text)
        raise Unparsable(f"unexpected {text!r}")

    def parse_bracket(self, open_: str):
        self.enter()
        closers = {"(": (")", "]"), "[": (")", "]"), r"\{": (r"\}",), "{": ("}",)}[open_]
        items = self.parse_list(closers)
        close = self.take()[1]
        self.depth -= 1
        if open_ == r"\{":
            return Bag(tuple(items))
        if len(items) == 1 and open_ + close in ("()", "{}"):
            return items[0]
        if open_ == "{":
            return Bag(tuple(items))
        return Seq(open_, close, tuple(items))

    def parse_command(self, cmd: str):
        sp = self.sp
        if cmd == r"\frac":
            num = self._scalar(self.parse_group())
            den = self._scalar(self.parse_group())
            return num / den
        if cmd == r"\sqrt":
            index = None
            if self.peek()[1] == "[":
                self.take()
                index = self._scalar(self.parse_expr())
                self.expect("]")
            arg = self._scalar(self.parse_group())
            if index is None:
                return sp.sqrt(arg)
            if not (index.is_Integer and 2 <= index <= MAX_ROOT_INDEX):
                raise Refused(f"root index must be an integer in 2..{MAX_ROOT_INDEX}")
            return sp.real_root(arg, index) if index % 2 else sp.root(arg, index)
        if cmd == r"\pi":
            return sp.pi
        if cmd == r"\infty":
            return sp.oo
        if cmd == r"\begin":
            return self.parse_matrix()
        name = cmd[1:]
        if name == "log" and self.peek()[1] == "_":
            self.take()
            base = self._scalar(self.parse_group())
            return sp.log(self._scalar(self.parse_power()), base)
        if name in _FUNCS:
            return self._apply(name, self.parse_power)
        raise Unparsable(f"unsupported command {cmd}")

    def parse_matrix(self):
        self.expect("{")
        env = self.take()[1]
        self.expect("}")
        if env not in ("pmatrix", "bmatrix", "matrix", "vmatrix"):
            raise Unparsable(f"unsupported environment {env!r}")
        rows, row = [], [self.parse_expr()]
        while True:
            text = self.take()[1]
            if text == "&":
                row.append(self.parse_expr())
            elif text == "\\\\":
                rows.append(Seq("M", "M", tuple(row)))
                if self.peek()[1] == r"\end":
                    row = []
                    self.take()
                    break
                row = [self.parse_expr()]
            elif text == r"\end":
                rows.append(Seq("M", "M", tuple(row)))
                row = []
                break
            else:
                raise Unparsable(f"unexpected {text!r} in a matrix")
        self.expect("{")
        self.take()
        self.expect("}")
        return Seq("M", "M", tuple(rows))

    def _apply(self, name: str, arg_parser):
        """`\\sin x`, `\\sin(x)`, `\\sin^2 x` (the square of the sine)."""
        power = None
        if self.peek()[1] == "^":
            self.take()
            power = self._scalar(self.parse_power_operand())
        fn = getattr(self.sp, _FUNCS.get(name, name))
        value = fn(self._scalar(arg_parser()))
        return value if power is None else self._pow(value, power)

    def _factorial(self, value):
        if not (getattr(value, "is_Integer", False) and 0 <= value <= 1000):
            raise Refused("factorial of something other than an integer in 0..1000")
        return self.sp.factorial(value)

    def _pow(self, base, exp):
        sp = self.sp
        if exp.is_number and not exp.has(sp.oo, sp.zoo, sp.nan):
            mag = _magnitude(exp, sp)
            if base.is_number:
                if base not in (0, 1, -1):
                    size = mag * max(abs(_log10(base, sp)), 1e-3)
                    if size > MAX_DIGITS or mag > 10 * MAX_DIGITS:
                        raise Refused("power too large")
            elif mag > MAX_SYMBOLIC_EXPONENT:
                raise Refused("symbolic power too large")
        return base**exp


def _magnitude(x, sp) -> float:
    try:
        v = complex(sp.N(x, 15))
    except (TypeError, ValueError, OverflowError):
        return math.inf
    return abs(v) if math.isfinite(abs(v)) else math.inf


def _log10(x, sp) -> float:
    if x.is_Rational:  # math.log10 takes big ints exactly, without converting them to float
        return math.log10(abs(int(x.p))) - math.log10(int(x.q)) if x.p else 0.0
    m = _magnitude(x, sp)
    return math.log10(m) if 0 < m < math.inf else math.inf


def _finite(value, sp) -> bool:
    if isinstance(value, Seq | Bag):
        return all(v in (sp.oo, -sp.oo) or _finite(v, sp) for v in value.items)
    return not value.has(sp.oo, -sp.oo, sp.zoo, sp.nan)


def parse_answer(s: str) -> Parsed:
    """Parses a normalised answer; raises `Unparsable` (outside the grammar or the limits)."""
    import sympy

    if not s:
        raise Unparsable("empty answer")
    parser = _Parser(_tokenize(s), sympy)
    items = parser.parse_list(("",))
    value = items[0] if len(items) == 1 else Bag(tuple(items))
    if value not in (sympy.oo, -sympy.oo) and not _finite(value, sympy):
        raise Refused("infinite, undefined or NaN value")
    return Parsed(value, parser.inexact)
