"""Record sources: JSONL and Parquet files (paths or globs) as random-access grain data sources.

A source is a sequence of dict records (`len`, `[i]`) that grain's `MapDataset.source` reads. Files
are read once at construction and checked there, so a bad file fails at start-up, not mid-run:

  * a malformed JSON line -> `RecordError` naming the file and the 1-based line number;
  * a record without a required field -> `RecordError` naming the field and the record
    (file:line, or file:row for Parquet) with its keys;
  * with `skip_bad_records=True` such records are dropped and counted (`bad_records`, reported as
    `data/bad_records` in `metrics()`); a source left with no records is still an error.

Every record gets a stable `uid` ("<file name>:<line or row>") unless it has one already; the
solve-rate tracker and the logs key prompts by it.
"""

from __future__ import annotations

import glob
import json
import logging
import os
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)

JSONL_SUFFIXES = (".jsonl", ".json", ".ndjson")
PARQUET_SUFFIXES = (".parquet", ".pq")


class RecordError(ValueError):
    """A bad record or file; the message names the file, line/row and what is wrong."""


class DataPathError(RecordError, FileNotFoundError):
    """A data path that names no data file (a `FileNotFoundError` too)."""


def expand_paths(patterns: Iterable[str | os.PathLike]) -> list[Path]:
    """Local paths and globs -> sorted, de-duplicated files; a pattern matching nothing fails."""
    out: list[Path] = []
    for pattern in patterns:
        text = os.path.expanduser(str(pattern))
        if glob.has_magic(text):
            matches = sorted(Path(p) for p in glob.glob(text, recursive=True) if Path(p).is_file())
            if not matches:
                raise DataPathError(f"data path glob {str(pattern)!r} matches no files")
            out.extend(matches)
        else:
            p = Path(text)
            if p.is_dir():
                matches = sorted(
                    q for q in p.iterdir() if q.suffix in JSONL_SUFFIXES + PARQUET_SUFFIXES
                )
                if not matches:
                    raise DataPathError(
                        f"data directory {str(p)!r} has no .jsonl/.parquet files")
                out.extend(matches)
            elif p.is_file():
                out.append(p)
            else:
                raise DataPathError(f"data path {str(pattern)!r} does not exist")
    seen: set[Path] = set()
    unique = []
    for p in out:
        if p.resolve() not in seen:
            seen.add(p.resolve())
            unique.append(p)
    if not unique:
        raise DataPathError("no data paths given")
    return unique


def _short(record: Any, limit: int = 160) -> str:
    text = json.dumps(record, ensure_ascii=False, default=str)
    return text if len(text) <= limit else text[:limit] + "..."


class RecordSource(Sequence):
    """In-memory list of validated dict records with uids; a grain random-access data source.

    Args:
      records: (location, record) pairs, location being "file:line" text for messages.
      required_fields: fields every record must have.
      transform: optional `fn(record, location) -> record` (e.g. parse a GSM8K answer); a
        `RecordError` it raises counts as a bad record.
      skip_bad_records: drop and count bad records instead of raising.
    """

    def __init__(
        self,
        records: Iterable[tuple[str, Any]],
        *,
        required_fields: Sequence[str] = (),
        transform: Callable[[dict, str], dict] | None = None,
        skip_bad_records: bool = False,
        name: str = "records",
    ):
        self.name = name
        self.bad_records = 0
        self.skip_bad_records = skip_bad_records
        self._records: list[dict] = []
        for location, rec in records:
            try:
                self._records.append(self._check(rec, location, required_fields, transform))
            except RecordError as e:
                if not skip_bad_records:
                    raise
                self._skip(e)
        if not self._records:
            raise RecordError(
                f"{name}: no usable records ({self.bad_records} bad records skipped)"
            )

    def _skip(self, err: Exception) -> None:
        self.bad_records += 1
        if self.bad_records <= 10:
            log.warning("skipping bad record (skip_bad_records=True): %s", err)

    @staticmethod
    def _check(rec, location, required_fields, transform) -> dict:
        if isinstance(rec, RecordError):
            raise rec
        if not isinstance(rec, dict):
            raise RecordError(
                f"{location}: record must be a JSON object, got {type(rec).__name__}: {_short(rec)}"
            )
        for field in required_fields:
            if field not in rec or rec[field] is None:
                raise RecordError(
                    f"{location}: record is missing required field {field!r} "
                    f"(has {sorted(rec)}): {_short(rec)}"
                )
        rec = dict(rec)
        rec.setdefault("uid", location)
        if transform is not None:
            rec = transform(rec, location)
        return rec

    def __len__(self) -> int:
        return len(self._records)

    def __getitem__(self, index):
        return self._records[index]

    def __repr__(self) -> str:
        return f"RecordSource({self.name!r}, {len(self)} records, {self.bad_records} bad)"

    def metrics(self) -> dict[str, float]:
        return {"data/bad_records": float(self.bad_records), "data/records": float(len(self))}

    def split_tail(self, n: int) -> tuple[RecordSource, RecordSource]:
        """(all but the last n, the last n) records: a held-out split when no eval file exists."""
        if not 0 < n < len(self):
            raise RecordError(
                f"{self.name}: cannot hold out {n} of {len(self)} records for eval; "
                "pass data.eval_paths or lower data.eval_size"
            )
        head, tail = _from_list(self._records[:-n], self), _from_list(self._records[-n:], self)
        return head, tail


def _from_list(records: list[dict], like: RecordSource) -> RecordSource:
    src = RecordSource.__new__(RecordSource)
    src.name, src.bad_records = like.name, like.bad_records
    src.skip_bad_records = like.skip_bad_records
    src._records = list(records)
    return src


def _jsonl_records(path: Path):
    """(location, record) per non-blank line of a UTF-8 file; a malformed line (bad JSON, or a
    byte that is not UTF-8) yields a RecordError naming the file and line instead."""
    with open(path, "rb") as f:
        for lineno, raw in enumerate(f, start=1):
            try:
                line = raw.decode("utf-8")
            except UnicodeDecodeError as e:
                yield f"{path}:{lineno}", RecordError(
                    f"{path}:{lineno}: not UTF-8 (byte {raw[e.start]:#04x} at column "
                    f"{e.start + 1}): {raw[:120]!r}")
                continue
            if not line.strip():
                continue
            try:
                rec = json.loads(line)
            except json.JSONDecodeError as e:
                rec = RecordError(
                    f"{path}:{lineno}: malformed JSON ({e.msg} at column {e.colno}): "
                    f"{line.strip()[:120]!r}"
                )
            yield f"{path}:{lineno}", rec


def _parquet_records(path: Path):
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(path)
    except Exception as e:  # noqa: BLE001 - re-raised with the file named
        raise RecordError(f"{path}: cannot read Parquet file: {e}") from e
    for row, rec in enumerate(table.to_pylist()):
        yield f"{path}:row{row}", rec


def load_records(
    paths: Iterable[str | os.PathLike],
    *,
    required_fields: Sequence[str] = (),
    transform: Callable[[dict, str], dict] | None = None,
    skip_bad_records: bool = False,
    name: str | None = None,
) -> RecordSource:
    """Read JSONL / Parquet files (by suffix; JSONL otherwise) into one `RecordSource`."""
    files = expand_paths(paths)

    def all_records():
        for path in files:
            if path.suffix.lower() in PARQUET_SUFFIXES:
                yield from _parquet_records(path)
            else:
                yield from _jsonl_records(path)

    return RecordSource(
        all_records(),
        required_fields=required_fields,
        transform=transform,
        skip_bad_records=skip_bad_records,
        name=name or ",".join(str(p) for p in files),
    )


class GeneratedSource(Sequence):
    """`size` records made on read by a pure `make(index) -> dict` (procedural tasks)."""

    def __init__(self, make: Callable[[int], dict], size: int, name: str):
        self._make, self._size, self.name = make, size, name
        self.bad_records = 0

    def __len__(self) -> int:
        return self._size

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self._make(i) for i in range(*index.indices(self._size))]
        if not -self._size <= index < self._size:
            raise IndexError(f"{self.name}: index {index} out of range [0, {self._size})")
        return self._make(index % self._size)

    def __repr__(self) -> str:
        return f"GeneratedSource({self.name!r}, {self._size} records)"

    def metrics(self) -> dict[str, float]:
        return {"data/bad_records": 0.0, "data/records": float(self._size)}
