"""Chrome / Perfetto trace of who was busy when: one track per role.

The controller records real wall-clock spans with `span`; the planner's simulator records
simulated spans with `add`. Both write the same file format, so a simulated timeline and a
measured one open side by side in https://ui.perfetto.dev (or chrome://tracing); `merge` puts
several traces in one file, one process row each.

Format (Chrome trace-event JSON): ``{"traceEvents": [...], "displayTimeUnit": "ms"}`` with

- ``"ph": "M"`` metadata events naming the process and one thread (track) per role,
- ``"ph": "X"`` complete events (``ts`` and ``dur`` in microseconds since the writer's origin),
- ``"ph": "C"`` counter events (e.g. queue depth, active decode slots).

Dependency-free and thread-safe: the generator, trainer, weight-sync and sandbox threads of the
controller may all write into one `TraceWriter`.

    trace = TraceWriter()
    with trace.span("trainer", "train_step", step=3):
        ...
    trace.add("weight_sync", "reshard", start_s=1.5, dur_s=0.2, gbytes=3.1)
    trace.counter("generator", "active_slots", t_s=1.7, slots=48)
    trace.save("runs/x/trace.json")
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any

ROLES: tuple[str, ...] = ("trainer", "generator", "weight_sync", "sandbox")
_US = 1e6


def _jsonable(value: Any) -> Any:
    """Args must survive json.dumps; numpy scalars and other objects become float or str."""
    if isinstance(value, (str, int, float, bool)) or value is None:
        return value
    try:
        return float(value)
    except (TypeError, ValueError):
        return str(value)


class TraceWriter:
    """Collects trace events in memory; `save` writes them atomically.

    Args:
      tracks: track names, in display order (default: the four roles). Writing to a track not
        listed raises ValueError naming the valid ones.
      process_name: label of the process row (e.g. "measured", "simulated").
      clock: monotonic clock in seconds used by `span` and `now`; its value at construction is
        the trace's origin (t = 0).
      pid: process id used in the events (distinct ids let several traces share one file).
    """

    def __init__(
        self,
        tracks: Sequence[str] = ROLES,
        *,
        process_name: str = "jaxrl",
        clock: Callable[[], float] = time.perf_counter,
        pid: int = 1,
    ) -> None:
        if not tracks or len(set(tracks)) != len(tracks):
            raise ValueError(f"tracks must be non-empty and unique, got {list(tracks)}")
        self._tids = {name: i + 1 for i, name in enumerate(tracks)}
        self._clock = clock
        self._origin = clock()
        self._pid = pid
        self._lock = threading.Lock()
        self._events: list[dict[str, Any]] = [
            {"ph": "M", "pid": pid, "tid": 0, "name": "process_name",
             "args": {"name": process_name}}
        ]
        for name, tid in self._tids.items():
            self._events.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_name", "args": {"name": name}}
            )
            self._events.append(
                {"ph": "M", "pid": pid, "tid": tid, "name": "thread_sort_index",
                 "args": {"sort_index": tid}}
            )

    @property
    def tracks(self) -> tuple[str, ...]:
        return tuple(self._tids)

    def now(self) -> float:
        """Seconds since this writer's origin, on its clock."""
        return self._clock() - self._origin

    def _tid(self, track: str) -> int:
        try:
            return self._tids[track]
        except KeyError:
            raise ValueError(
                f"unknown trace track {track!r}; valid tracks: {list(self._tids)}"
            ) from None

    def add(self, track: str, name: str, start_s: float, dur_s: float, **args: Any) -> None:
        """Records a complete event that started `start_s` seconds after the origin."""
        if dur_s < 0:
            raise ValueError(f"dur_s must be >= 0, got {dur_s} for {track}/{name}")
        event = {
            "ph": "X", "pid": self._pid, "tid": self._tid(track), "name": name,
            "ts": round(start_s * _US, 3), "dur": round(dur_s * _US, 3),
        }
        if args:
            event["args"] = {k: _jsonable(v) for k, v in args.items()}
        with self._lock:
            self._events.append(event)

    @contextlib.contextmanager
    def span(self, track: str, name: str, **args: Any) -> Iterator[None]:
        """Times the body on this writer's clock and records it, even if the body raises."""
        self._tid(track)  # fail before running the body, not after
        start = self.now()
        try:
            yield
        finally:
            self.add(track, name, start, max(self.now() - start, 0.0), **args)

    def counter(self, track: str, name: str, t_s: float, **values: float) -> None:
        """Records counter values (a "C" event) at `t_s` seconds after the origin."""
        if not values:
            raise ValueError(f"counter {name!r} needs at least one value")
        event = {
            "ph": "C", "pid": self._pid, "tid": self._tid(track), "name": name,
            "ts": round(t_s * _US, 3), "args": {k: _jsonable(v) for k, v in values.items()},
        }
        with self._lock:
            self._events.append(event)

    def events(self) -> list[dict[str, Any]]:
        """A copy of the events recorded so far (metadata first)."""
        with self._lock:
            return [dict(e) for e in self._events]

    def to_dict(self) -> dict[str, Any]:
        return {"traceEvents": self.events(), "displayTimeUnit": "ms"}

    def save(self, path: str | os.PathLike[str]) -> str:
        """Writes the trace as JSON atomically (temporary file in the same folder, then rename)."""
        return _atomic_write_json(os.fspath(path), self.to_dict())


def _atomic_write_json(path: str, obj: Mapping[str, Any]) -> str:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=".trace-", suffix=".tmp", dir=folder)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(obj, f, separators=(",", ":"))
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return path


def merge(traces: Mapping[str, str | os.PathLike[str]], out: str | os.PathLike[str]) -> str:
    """Puts several saved traces in one file, one process row per label (e.g. measured vs
    simulated), so Perfetto shows them one above the other on the same time axis."""
    events: list[dict[str, Any]] = []
    for pid, (label, path) in enumerate(traces.items(), start=1):
        with open(path) as f:
            loaded = json.load(f)
        for event in loaded["traceEvents"]:
            event = dict(event, pid=pid)
            if event.get("ph") == "M" and event.get("name") == "process_name":
                event["args"] = {"name": label}
            events.append(event)
    return _atomic_write_json(os.fspath(out), {"traceEvents": events, "displayTimeUnit": "ms"})
