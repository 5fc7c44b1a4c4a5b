"""Whether a checkpoint step directory can be trusted, and the record that lets a later run tell.

Orbax writes a step under a temporary name and renames it when every process has written its
part, so a step cut off by SIGKILL never looks finished. It does not notice files damaged or
lost after that (a garbled data file restores silently as wrong numbers). So, once orbax has
written every file of a step and before the rename, `seal(step_dir)` adds `jaxrl_integrity.json`:
the size and CRC32 of each file. `problem(step_dir, extras)` names the first thing wrong with a
step directory, or returns None:

  - not a finished step (a temporary `N.orbax-checkpoint-tmp-*` name), or its integrity record,
    a file it lists, or orbax's metadata missing;
  - a file of another size (truncated) or another checksum (garbled) than when it was written;
  - metadata that is not JSON, or the extra data state without an item the run registered.

A step without a record (written by a jaxrl that did not seal) is checked by its metadata only.
"""

from __future__ import annotations

import json
import zlib
from collections.abc import Iterable
from pathlib import Path

RECORD = "jaxrl_integrity.json"
# written by orbax around the commit (timestamps), so not in the record: checked as JSON
_UNSEALED = ("_CHECKPOINT_METADATA",)
_METADATA = ("_CHECKPOINT_METADATA", "state/_METADATA", "extra/metadata")


def _crc32(path: Path) -> int:
    crc = 0
    with open(path, "rb") as f:
        while chunk := f.read(1 << 22):
            crc = zlib.crc32(chunk, crc)
    return crc


def _files(step_dir: Path) -> list[Path]:
    return sorted(p for p in step_dir.rglob("*")
                  if p.is_file() and p.name != RECORD and p.name not in _UNSEALED)


def seal(step_dir: str | Path) -> None:
    """Write the integrity record of a step directory whose files are all written."""
    step_dir = Path(step_dir)
    record = {str(p.relative_to(step_dir)): [p.stat().st_size, _crc32(p)]
              for p in _files(step_dir)}
    tmp = step_dir / (RECORD + ".tmp")
    tmp.write_text(json.dumps({"version": 1, "files": record}))
    tmp.replace(step_dir / RECORD)


def problem(step_dir: str | Path, extras: Iterable[str] = ()) -> str | None:
    """The first reason `step_dir` is not a complete checkpoint, or None."""
    step_dir = Path(step_dir)
    if not step_dir.name.isdigit():
        return f"{step_dir.name} is not a finished step (its save did not complete)"
    if not step_dir.is_dir():
        return "the step directory is missing"
    parsed = {}
    for name in _METADATA:
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        try:
            parsed[name] = json.loads(path.read_bytes())
        except (ValueError, OSError) as e:
            return f"{name} is not readable JSON ({e})"
    extra = parsed["extra/metadata"]
    missing = sorted(set(extras) - set(extra if isinstance(extra, dict) else ()))
    if missing:
        return f"the extra data state lacks {missing}"
    record_path = step_dir / RECORD
    if not record_path.is_file():
        return None  # written before checkpoints were sealed: the metadata checks above only
    try:
        files = json.loads(record_path.read_bytes())["files"]
    except (ValueError, KeyError, TypeError, OSError) as e:
        return f"{RECORD} is not readable ({e})"
    for name, (size, crc) in sorted(files.items()):
        path = step_dir / name
        if not path.is_file():
            return f"{name} is missing"
        if path.stat().st_size != size:
            return f"{name} has {path.stat().st_size} bytes, {size} when written (truncated?)"
        if _crc32(path) != crc:
            return f"{name} differs from what was written (checksum mismatch: garbled)"
    return None
