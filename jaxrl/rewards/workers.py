"""Killable worker processes for reward functions that may hang, crash or blow up memory.

A reward function such as a sympy equivalence check or a regex can run for ever on a hostile
completion. Python cannot interrupt such code from another thread, and a signal-based timeout only
works on the main thread. So these functions run in a few worker processes: on a deadline the worker
is SIGKILLed and a fresh one starts in its place. Workers also run under an address-space limit.

    with KillableWorkers(num_workers=2) as workers:
        outs = workers.map(fn, [(a1,), (a2,)], timeout_s=5.0)   # each: value, or a WorkerError

`fn` is pickled by reference, so it must be a module-level function (or a `functools.partial` of
one). Results come back in input order; a timed-out or crashed call yields a `RewardTimeout` or
`WorkerError` instance in its place instead of raising, so one bad item never fails the batch.
"""

from __future__ import annotations

import collections
import importlib
import logging
import multiprocessing as mp
import multiprocessing.connection as mp_connection
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

log = logging.getLogger(__name__)

_START_METHODS = ("forkserver", "spawn", "fork")


class WorkerError(Exception):
    """A reward call failed in its worker (raised, crashed, or could not be sent back)."""


class RewardTimeout(WorkerError):
    """A reward call ran past its deadline; its worker was killed."""


def _worker_main(conn, memory_mb: int | None, preload: tuple[str, ...]) -> None:
    if memory_mb:
        import resource

        limit = int(memory_mb) << 20
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    for name in preload:
        try:
            importlib.import_module(name)
        except Exception:  # a missing optional module must not kill the worker
            pass
    conn.send(("ready", None))
    while True:
        try:
            msg = conn.recv()
        except (EOFError, OSError):
            return
        if msg is None:
            return
        fn, args = msg
        try:
            out = ("ok", fn(*args))
        except BaseException as e:  # noqa: BLE001 - everything is reported, nothing escapes
            out = ("err", f"{type(e).__name__}: {e}"[:1000])
        try:
            conn.send(out)
        except Exception as e:  # e.g. an unpicklable result
            conn.send(("err", f"result could not be sent back: {type(e).__name__}: {e}"[:1000]))


class _Slot:
    __slots__ = ("proc", "conn", "state", "index", "deadline", "since")

    def __init__(self, proc, conn):
        self.proc, self.conn = proc, conn
        self.state = "starting"  # starting -> idle <-> busy
        self.index = -1
        self.deadline = 0.0
        self.since = time.monotonic()


class KillableWorkers:
    """A small pool of processes that run picklable functions with a hard per-call deadline.

    Args:
      num_workers: processes run at once.
      memory_mb: RLIMIT_AS of each worker (None: no limit).
      preload: modules each worker imports before taking work (e.g. "sympy"), so their import
        time never counts against a call's deadline.
      start_method: one of "forkserver" (default), "spawn", "fork".
      start_timeout_s: how long a worker may take to start and preload.
    """

    def __init__(
        self,
        num_workers: int = 2,
        *,
        memory_mb: int | None = 2048,
        preload: Sequence[str] = (),
        start_method: str = "forkserver",
        start_timeout_s: float = 60.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
        if start_method not in _START_METHODS:
            raise ValueError(f"start_method must be one of {_START_METHODS}, got {start_method!r}")
        self.num_workers = int(num_workers)
        self.memory_mb = memory_mb
        self.preload = tuple(preload)
        self.start_timeout_s = float(start_timeout_s)
        self._ctx = mp.get_context(start_method)
        self._slots: list[_Slot | None] = [None] * self.num_workers
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts = 0  # calls killed on their deadline
        self.crashes = 0  # workers that died during a call (segfault, OOM kill, ...)
        self.starts = 0  # worker processes started (first ones and replacements)

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> KillableWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, i: int) -> _Slot:
        parent, child = self._ctx.Pipe(duplex=True)
        proc = self._ctx.Process(
            target=_worker_main,
            args=(child, self.memory_mb, self.preload),
            name=f"jaxrl-reward-worker-{i}",
            daemon=True,
        )
        proc.start()
        self.starts += 1
        child.close()
        slot = _Slot(proc, parent)
        self._slots[i] = slot
        return slot

    def _kill(self, i: int) -> None:
        slot = self._slots[i]
        self._slots[i] = None
        if slot is None:
            return
        slot.proc.kill()
        slot.proc.join(timeout=10)
        slot.conn.close()

    def close(self) -> None:
        """Stops all workers (politely, then by SIGKILL). Safe to call twice."""
        with self._lock:
            self._closed = True
            for i, slot in enumerate(self._slots):
                if slot is None:
                    continue
                try:
                    slot.conn.send(None)
                except OSError:
                    pass
                slot.proc.join(timeout=1)
                self._kill(i)

    def pids(self) -> list[int]:
        """Pids of the live workers (for tests and metrics)."""
        return [s.proc.pid for s in self._slots if s is not None and s.proc.pid is not None]

    # -- work -----------------------------------------------------------------------------------

    def map(self, fn: Callable[..., Any], args: Sequence[tuple], *, timeout_s: float) -> list[Any]:
        """Runs `fn(*a)` for each `a` in `args` across the workers, in input order.

        Each entry of the result is the call's return value, or a `RewardTimeout` (deadline
        passed, worker killed and replaced) or `WorkerError` (raised or crashed) instance.
        """
        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s!r}")
        with self._lock:
            if self._closed:
                raise RuntimeError("KillableWorkers is closed")
            return self._map_locked(fn, list(args), float(timeout_s))

    def _map_locked(self, fn, args: list[tuple], timeout_s: float) -> list[Any]:
        results: list[Any] = [None] * len(args)
        pending = collections.deque(range(len(args)))
        done = 0
        start_failures = 0
        while done < len(args):
            now = time.monotonic()
            # Hand work to idle workers; start replacements for killed ones.
            for i, slot in enumerate(self._slots):
                if slot is None and pending:
                    slot = self._start(i)
                if slot is not None and slot.state == "idle" and pending:
                    k = pending.popleft()
                    try:
                        slot.conn.send((fn, args[k]))
                    except Exception as e:  # unpicklable fn/args, or a dead pipe
                        results[k] = WorkerError(f"could not send call: {type(e).__name__}: {e}")
                        done += 1
                        if isinstance(e, OSError):
                            self._kill(i)
                        continue
                    slot.state, slot.index, slot.deadline = "busy", k, now + timeout_s
            deadlines = []
            for s in self._slots:
                if s is None:
                    continue
                if s.state == "busy":
                    deadlines.append(s.deadline)
                elif s.state == "starting":
                    deadlines.append(s.since + self.start_timeout_s)
            if not deadlines:
                continue
            waitable = {s.conn: i for i, s in enumerate(self._slots) if s is not None}
            ready = mp_connection.wait(list(waitable), timeout=max(0.0, min(deadlines) - now))
            for conn in ready:
                i = waitable[conn]
                slot = self._slots[i]
                try:
                    kind, value = conn.recv()
                except (EOFError, OSError):
                    slot.proc.join(timeout=1)
                    code = slot.proc.exitcode
                    if slot.state == "busy":
                        self.crashes += 1
                        results[slot.index] = WorkerError(f"worker died (exit code {code})")
                        done += 1
                    else:
                        log.warning("reward worker %d died while starting (exit code %s)", i, code)
                        start_failures += 1
                    self._kill(i)
                    if start_failures > 2 * self.num_workers:
                        msg = f"reward workers keep dying at start (exit code {code})"
                        raise WorkerError(msg) from None
                    continue
                if slot.state == "starting":
                    slot.state = "idle"
                elif slot.state == "busy":
                    results[slot.index] = value if kind == "ok" else WorkerError(value)
                    done += 1
                    slot.state = "idle"
            now = time.monotonic()
            for i, slot in enumerate(self._slots):
                if slot is None:
                    continue
                if slot.state == "busy" and now >= slot.deadline:
                    self.timeouts += 1
                    results[slot.index] = RewardTimeout(f"reward call passed {timeout_s:g} s")
                    done += 1
                    self._kill(i)
                elif slot.state == "starting" and now >= slot.since + self.start_timeout_s:
                    self._kill(i)
                    raise WorkerError(
                        f"reward worker {i} did not start within {self.start_timeout_s:g} s"
                    )
        return results
