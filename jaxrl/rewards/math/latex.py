"""Answer extraction and normalisation for the `math_answer` reward.

`extract_answer` picks the final answer out of a completion (last `\\boxed{}`, GSM8K `#### N`, last
number); `normalize` strips what does not change an answer's value (LaTeX wrappers and spacing,
units and `%` as configured, `x = ` before the value, thousands separators). The normalised text
goes to `parse.parse_answer`.
"""

from __future__ import annotations

import re

# --- extraction ----------------------------------------------------------------------------------

_BOX_RE = re.compile(r"\\(?:boxed|fbox)(?:\s*(\{)|\s+(?=[^\s{]))")
_NUMBER_RE = re.compile(r"-?\d[\d,]*(?:\.\d+)?(?:\s*/\s*\d+)?|-?\.\d+")
_GSM8K_RE = re.compile(r"####\s*(\S[^\n]*)")
_NUMBER_THEN_WORDS_RE = re.compile(r"(\\?\$?-?\d[\d,]*(?:\.\d+)?)\s+[A-Za-z]")


def _brace_matches(text: str) -> dict[int, int]:
    """{index of '{': index of its '}'} for every balanced pair, in one pass."""
    stack, match = [], {}
    for i, c in enumerate(text):
        if c == "{":
            stack.append(i)
        elif c == "}" and stack:
            match[stack.pop()] = i
    return match


def extract_answer(text: str) -> str | None:
    """The last `\\boxed{...}` (nested braces kept; `\\fbox`, `\\boxed 5` too), else the text
    after a GSM8K `#### `, else the last number; None if there is none. Linear in `len(text)`."""
    boxes = list(_BOX_RE.finditer(text))
    if boxes:
        match = _brace_matches(text) if any(m.group(1) for m in boxes) else {}
        for m in reversed(boxes):
            if m.group(1):
                end = match.get(m.end() - 1)
                if end is not None:
                    return text[m.end() : end].strip()
            else:
                word = re.match(r"[^\s$]+", text[m.end() :])
                if word:
                    return word.group()
    hashes = list(_GSM8K_RE.finditer(text))
    if hashes:
        after = hashes[-1].group(1).strip()
        words = _NUMBER_THEN_WORDS_RE.match(after)  # "#### 72 clips": 72; not "#### 72 or 73"
        if words and not re.search(r"\d|\bor\b", after[words.end(1) :], re.IGNORECASE):
            return words.group(1)
        return after
    numbers = _NUMBER_RE.findall(text)
    if numbers:
        return numbers[-1].rstrip(",").strip()
    return None


# --- normalisation -------------------------------------------------------------------------------

UNITS_CHOICES = ("strip", "keep")
PERCENT_CHOICES = ("strip", "value", "keep")

_DROP = (
    r"\left",
    r"\right",
    r"\displaystyle",
    r"\!",
    r"\,",
    r"\;",
    r"\:",
    r"\ ",
    r"\quad",
    r"\qquad",
    "~",
    "$",
)
_TEXT_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|mbox|mathrm|mathbf|operatorname)\s*\{([^{}]*)\}"
)
_DEGREE_RE = re.compile(r"\^\s*\{?\s*\\circ\s*\}?|\\circ|°|\\degree")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(,\d{3})+(\.\d+)?$")
_UNIT_WORD = (
    r"(?:degrees?|radians?|cm|mm|km|meters?|metres?|inch(?:es)?|in\.|feet|foot|ft|yards?|miles?|"
    r"kg|grams?|pounds?|lbs?|ounces?|oz|liters?|litres?|ml|gallons?|"
    r"hours?|hrs?|minutes?|mins?|seconds?|secs?|days?|weeks?|months?|years?|"
    r"mph|dollars?|cents?|units?|people|students|apples|marbles|cookies|pages|books)"
)
# Runs on single-spaced text; every space has one place in a match (no nested optional spaces:
# an ambiguous version of this pattern took minutes on "1 cm cm ... cm x").
_UNIT = rf"(?:(?:square|sq\.?|cubic) )?{_UNIT_WORD}(?: ?\^ ?\{{?[23]\}}?| per [a-z]+)?"
_UNITS_TAIL_RE = re.compile(rf"(?<=[\d}})\].]) ?{_UNIT}(?: {_UNIT})*$", re.IGNORECASE)
_ONE_LETTER_UNITS_TAIL_RE = re.compile(r"(?<=[\d}])\s+(?:m|g|s|h|l)(?:\^\{?[23]\}?)?$")
_MIXED_RE = re.compile(r"^(-?)(\d+)\\frac\{?(\d+)\}?\{?(\d+)\}?$")
_SPACE_RE = re.compile(r"(\\[A-Za-z]+)?\s+(?=([A-Za-z])?)")
_WORD_SEP_RE = re.compile(r"\s+(?:or|and)\s+|\s*;\s*")
_LHS_RE = re.compile(r"^\s*(?:[A-Za-z](?:_\{?\w+\}?)?|\\[a-z]+)\s*(?:=|\\in)\s*(?!=)")


def normalize(ans: str, *, units: str = "strip", percent: str = "strip") -> str:
    """Canonical string form of an answer. `units="strip"` drops trailing units (`5 \\text{ cm}`,
    `30^\\circ`, `\\$`); `percent="strip"` reads `50\\%` as 50, `"value"` as 0.5 (`/100`), `"keep"`
    leaves the sign (which then only matches the same string)."""
    s = ans.strip()
    s = re.sub(r"\\[dt]frac", r"\\frac", s)
    s = s.replace(r"\$", " " if units == "strip" else "\0")  # a dollar sign is a unit
    pieces = s.split("\\\\")  # matrix row breaks survive the dropping of "\ " spacing
    for token in _DROP:
        pieces = [p.replace(token, "") for p in pieces]
    s = "\\\\".join(pieces).replace("\0", r"\$").replace("{,}", "")
    s = _TEXT_RE.sub(lambda m: " " + m.group(1) + " ", s)
    if percent == "strip":
        s = s.replace(r"\%", "").replace("%", "")
    elif percent == "value":
        s = re.sub(r"\s*\\?%", "/100", s)
    if units == "strip":
        s = _DEGREE_RE.sub("", s)
    s = " ".join(s.split()).rstrip(".").strip()
    if units == "strip":
        s = _ONE_LETTER_UNITS_TAIL_RE.sub("", s)
        s = _UNITS_TAIL_RE.sub("", s).strip()
    s = _WORD_SEP_RE.sub(",", s)
    m = _LHS_RE.match(s)  # "x = 5", "x \in [1, 2)": the value only
    if m and "=" not in s[m.end() :]:
        s = s[m.end() :]
    if _THOUSANDS_RE.match(s.replace(" ", "")):
        s = s.replace(",", "")
    # Spaces go, except one that ends a command before a letter: "\\pi r" is not "\\pir".
    s = _SPACE_RE.sub(
        lambda m: m.group(1) + " " if m.group(1) and m.group(2) else m.group(1) or "", s
    )
    # A whole answer "3\frac{1}{2}" is the mixed number 7/2 (elsewhere juxtaposition multiplies).
    return _MIXED_RE.sub(r"\1(\2+\\frac{\3}{\4})", s)
