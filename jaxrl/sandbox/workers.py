"""Killable worker processes for reward functions that may hang, crash or blow up memory.

A reward function such as a sympy equivalence check or a regex can run for ever on a hostile
completion. Python cannot interrupt such code from another thread, and a signal-based timeout only
works on the main thread. So these functions run in a few worker processes: on a deadline the worker
is SIGKILLed and a fresh one starts in its place. Workers also run under an address-space limit.

    with KillableWorkers(num_workers=2) as workers:
        outs = workers.map(fn, [(a1,), (a2,)], timeout_s=5.0)   # each: value, or a WorkerError

`fn` is pickled once per `map` with cloudpickle: a function of an importable module goes by
reference (the worker imports it), one the workers cannot import (an experiment file loaded by
path, `__main__`, a closure or a lambda) goes by value, with the globals it uses. Workers are fresh
interpreters started with `python -c` and this process's `sys.path`; unlike multiprocessing's
spawn/forkserver they never re-import `__main__` (which would fail for `python -`, and would import
jax for a training script).

Results come back in input order; a timed-out or crashed call yields a `RewardTimeout` or
`WorkerError` instance in its place instead of raising, so one bad item never fails the batch.
"""

from __future__ import annotations

import atexit
import collections
import importlib
import logging
import multiprocessing.connection as mp_connection
import os
import pickle
import socket
import subprocess
import sys
import threading
import time
import weakref
from collections.abc import Callable, Sequence
from typing import Any

import cloudpickle

log = logging.getLogger(__name__)

_ENTRY = "from jaxrl.sandbox.workers import _worker_entry; _worker_entry()"


class WorkerError(Exception):
    """A reward call failed in its worker (raised, crashed, or could not be sent back)."""


class RewardTimeout(WorkerError):
    """A reward call ran past its deadline; its worker was killed."""


def _worker_entry() -> None:
    """Worker process body: `python -c <_ENTRY> <fd> <memory_mb> <preload,...>`."""
    fd, memory_mb, preload = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3]
    conn = mp_connection.Connection(fd)
    parent = os.getppid()

    def orphan_watch() -> None:  # a busy worker must not outlive its parent
        while os.getppid() == parent:
            time.sleep(1.0)
        os._exit(0)

    threading.Thread(target=orphan_watch, daemon=True).start()
    if memory_mb > 0:
        import resource

        resource.setrlimit(resource.RLIMIT_AS, (memory_mb << 20, memory_mb << 20))
    for name in filter(None, preload.split(",")):
        try:
            importlib.import_module(name)
        except Exception:  # a missing optional module must not kill the worker
            pass
    conn.send(("ready", None))
    loaded: tuple[bytes, Callable] | None = None  # the last function received, unpickled once
    while True:
        try:
            raw = conn.recv_bytes()
        except (EOFError, OSError):
            return
        try:
            msg = pickle.loads(raw)
            if msg is None:
                return
            fn_bytes, args = msg
            if loaded is None or loaded[0] != fn_bytes:
                loaded = (fn_bytes, pickle.loads(fn_bytes))
            out = ("ok", loaded[1](*args))
        except BaseException as e:  # noqa: BLE001 - everything is reported, nothing escapes
            out = ("err", f"{type(e).__name__}: {e}"[:1000])
        try:
            conn.send(out)
        except Exception as e:  # e.g. an unpicklable result
            conn.send(("err", f"result could not be sent back: {type(e).__name__}: {e}"[:1000]))


_LIVE: weakref.WeakSet = weakref.WeakSet()


@atexit.register
def _close_all() -> None:
    for workers in list(_LIVE):
        workers.close()


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
      start_timeout_s: how long a worker may take to start and preload.
    """

    def __init__(
        self,
        num_workers: int = 2,
        *,
        memory_mb: int | None = 2048,
        preload: Sequence[str] = (),
        start_timeout_s: float = 60.0,
    ):
        if num_workers < 1:
            raise ValueError(f"num_workers must be >= 1, got {num_workers!r}")
        self.num_workers = int(num_workers)
        self.memory_mb = memory_mb
        self.preload = tuple(preload)
        self.start_timeout_s = float(start_timeout_s)
        self._slots: list[_Slot | None] = [None] * self.num_workers
        self._lock = threading.Lock()
        self._closed = False
        self.timeouts = 0  # calls killed on their deadline
        self.crashes = 0  # workers that died during a call (segfault, OOM kill, ...)
        self.starts = 0  # worker processes started (first ones and replacements)
        _LIVE.add(self)

    # -- life cycle ---------------------------------------------------------------------------

    def __enter__(self) -> KillableWorkers:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def _start(self, i: int) -> _Slot:
        parent, child = socket.socketpair()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join(p for p in sys.path if p)
        try:
            proc = subprocess.Popen(
                [
                    sys.executable,
                    "-c",
                    _ENTRY,
                    str(child.fileno()),
                    str(self.memory_mb or 0),
                    ",".join(self.preload),
                ],
                pass_fds=(child.fileno(),),
                env=env,
                stdin=subprocess.DEVNULL,
            )
        finally:
            child.close()
        self.starts += 1
        parent = mp_connection.Connection(parent.detach())
        slot = _Slot(proc, parent)
        self._slots[i] = slot
        return slot

    def _kill(self, i: int) -> None:
        slot = self._slots[i]
        self._slots[i] = None
        if slot is None:
            return
        slot.proc.kill()
        try:
            slot.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            log.error("reward worker %d ignored SIGKILL", slot.proc.pid)
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
                try:
                    slot.proc.wait(timeout=1)
                except subprocess.TimeoutExpired:
                    pass
                self._kill(i)

    def pids(self) -> list[int]:
        """Pids of the live workers (for tests and metrics)."""
        return [s.proc.pid for s in self._slots if s is not None]

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
            try:
                fn_bytes = cloudpickle.dumps(fn)
            except Exception as e:  # noqa: BLE001 - e.g. a function holding a lock or a socket
                err = WorkerError(f"could not send call: {type(e).__name__}: {e}"[:1000])
                return [err] * len(args)
            return self._map_locked(fn_bytes, list(args), float(timeout_s))

    def _map_locked(self, fn_bytes: bytes, args: list[tuple], timeout_s: float) -> list[Any]:
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
                        slot.conn.send((fn_bytes, args[k]))
                    except Exception as e:  # unpicklable args, or a dead pipe
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
                    try:
                        code = slot.proc.wait(timeout=1)
                    except subprocess.TimeoutExpired:
                        code = None
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
