"""The planner's data tables (`jaxrl/planner/data/*.toml`): read once, checked row by row.

A row is one TOML table: its figures, a `source` (the URL or document the figures were read
from) and a `date` (an ISO date, when they were read). A malformed file or row is a ValueError
that names the file, the row and the field.
"""

from __future__ import annotations

import datetime
import tomllib
from importlib import resources
from importlib.resources.abc import Traversable
from typing import Any

DATA = resources.files("jaxrl.planner") / "data"  # the shipped tables
COMMON = {"source": str, "date": str}


def read(path: Traversable) -> dict[str, Any]:
    """The TOML file at `path`; a syntax error names the file, line and column."""
    try:
        with path.open("rb") as f:
            return tomllib.load(f)
    except tomllib.TOMLDecodeError as e:
        raise ValueError(f"{path}: not valid TOML: {e}") from None


def check_row(path: Traversable, row: str, entry: Any, fields: dict[str, type],
              optional: tuple[str, ...] = ("note",)) -> dict[str, Any]:
    """`entry`, the row named `row` of `path`, with `fields` (float, int or str), a non-empty
    `source` and an ISO `date` (a TOML date or a "YYYY-MM-DD" string, returned as the string)."""
    if not isinstance(entry, dict):
        raise ValueError(f"{path}: row {row}: expected a table of fields, got {entry!r}")
    want = {**fields, **COMMON}
    missing = sorted(set(want) - set(entry))
    if missing:
        raise ValueError(f"{path}: row {row}: field {missing[0]!r} is missing (every row "
                         f"needs {sorted(want)})")
    out = {}
    for field, value in entry.items():
        kind = want.get(field, str if field in optional else None)
        if field == "date" and isinstance(value, datetime.date):
            value = value.isoformat()
        if kind is None:
            why = f"unknown field; valid: {sorted([*want, *optional])}"
        elif not (isinstance(value, int | float) and not isinstance(value, bool)
                  if kind is float else type(value) is kind):
            why = f"expected {kind.__name__}, got {value!r}"
        elif kind is str and not value.strip():
            why = "empty"
        elif field == "date" and not _is_iso(value):
            why = f"expected an ISO date YYYY-MM-DD, got {value!r}"
        else:
            out[field] = float(value) if kind is float else value
            continue
        raise ValueError(f"{path}: row {row}: field {field!r}: {why}")
    return out


def _is_iso(text: str) -> bool:
    try:
        return datetime.date.fromisoformat(text).isoformat() == text
    except ValueError:
        return False
