"""SessionPool: stateful Python tool sessions, one per episode, each in a warm sandbox zygote.

    with SessionPool(num_slots=8) as pool:
        with pool.open() as s:                   # waits (first come, first served) for a free slot
            s.run("x = 6")                       # ToolResult(status="ok", stdout="", ...)
            s.run("x * 7").stdout                # "42\n": variables persist across calls
        pool.stats()                             # open sessions, how sessions ended, call p50/p99

A session is a REPL process forked by a zygote (`zygote_session.py`), with a job's limits and
isolation; a zygote holds one session at a time, so concurrent episodes never share a uid or a
namespace. Each call has its own wall-clock timeout and output cap; a call that passes either, or
whose session exits, ends the session (`ToolResult.closed`), and the session's whole process tree
and files go with it. Closing a session does the same. The next session on that slot is a fresh
process in a wiped directory; a zygote that could not wipe is replaced.

Slots are leased first come, first served; a session holds its slot until closed (an idle REPL
costs memory, not CPU), so `num_slots` bounds concurrent episodes, not CPU use.
"""

from __future__ import annotations

import collections
import dataclasses
import logging
import marshal
import queue
import threading
import time

from jaxrl.sandbox import zygote_session as ss
from jaxrl.sandbox.plan import UidLease, default_uid_base
from jaxrl.sandbox.pool import TIERS, PoolStats, ZygoteProcess, _pct, probe
from jaxrl.sandbox.types import SandboxResult
from jaxrl.sandbox.zygote import write_frame

log = logging.getLogger(__name__)

_OP_GRACE_S = 10.0  # beyond a call's timeout: the zygote's kill + sweep is bounded by ~5 s
ENDINGS = ("timeout", "output_limit", "exited", "killed")  # how a session can end by itself


@dataclasses.dataclass(frozen=True)
class ToolResult:
    """One call's outcome. `closed`: the session ended with this call (its `status` says why)."""

    status: str  # ok | error | timeout | output_limit | exited | killed | closed
    stdout: str
    stderr: str
    wall_s: float
    closed: bool = False


class _SessionZygote(ZygoteProcess):
    def op(self, spec: dict, timeout_s: float) -> tuple | None:
        """(status, flags, t_start, t_end, out, err), or None if the zygote broke."""
        try:
            write_frame(self._in, marshal.dumps(spec))
        except OSError:
            self.failure = "died"
            return None
        reply = self._read_frame(time.monotonic() + timeout_s + _OP_GRACE_S)
        if reply is None or len(reply) < ss.SESSION_HEADER.size:
            return None
        st, flags, t0, t1, n_out, n_err = ss.SESSION_HEADER.unpack_from(reply)
        body = reply[ss.SESSION_HEADER.size:]
        if st >= len(ss.SESSION_STATUSES) or n_out + n_err != len(body):
            return None
        return (ss.SESSION_STATUSES[st], flags, t0, t1, body[:n_out].decode("utf-8", "replace"),
                body[n_out:].decode("utf-8", "replace"))


class _Spawner:
    """One long-lived thread that starts every zygote: a zygote's parent-death signal is tied to
    the thread that spawned it, and callers (tool threads) come and go."""

    def __init__(self):
        self._q: queue.SimpleQueue = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="session-spawner", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        while (item := self._q.get()) is not None:
            fn, box, done = item
            try:
                box.append(fn())
            except BaseException as e:  # noqa: BLE001 - handed to the caller
                box.append(e)
            done.set()

    def call(self, fn):
        box, done = [], threading.Event()
        self._q.put((fn, box, done))
        done.wait()
        if isinstance(box[0], BaseException):
            raise box[0]
        return box[0]

    def stop(self) -> None:
        self._q.put(None)
        self._thread.join(10)


class Session:
    """One episode's REPL. Calls are serialised; after `closed` every call answers "closed"."""

    def __init__(self, pool: SessionPool, slot: int):
        self._pool, self._slot, self._lock = pool, slot, threading.Lock()
        self.closed, self.ended_by, self.calls = False, None, 0

    def run(self, code: str, *, timeout_s: float = 5.0, max_output_bytes: int = 1 << 16,
            ) -> ToolResult:
        if not (0 < timeout_s <= 3600) or not (0 < max_output_bytes <= 1 << 24):
            raise ValueError(f"timeout_s must be in (0, 3600] and max_output_bytes in (0, 16 MiB],"
                             f" got {timeout_s!r}, {max_output_bytes!r}")
        with self._lock:
            if self.closed:
                return ToolResult("closed", "", f"the session ended ({self.ended_by})", 0.0, True)
            self.calls += 1
            spec = dict(session="call", code=str(code), timeout_s=float(timeout_s),
                        max_output_bytes=int(max_output_bytes))
            got = self._pool._op(self._slot, spec, timeout_s)
            status, flags, t0, t1, out, err = got or ("killed", ss.CLOSED, 0.0, 0.0, "", "")
            if got is None:
                err = "sandbox session worker broke during this call; it was replaced"
            result = ToolResult(status, out, err, max(0.0, t1 - t0), bool(flags & ss.CLOSED))
            self._pool._record_call(result)
            if result.closed:
                self._end(status, flags, replaced=got is None)
            return result

    def close(self) -> None:
        """Ends the session (kills what it started, wipes its files) and frees its slot."""
        with self._lock:
            if self.closed:
                return
            got = self._pool._op(self._slot, dict(session="close"), 5.0)
            self._end("closed", got[1] if got else 0, replaced=got is None)

    def _end(self, why: str, flags: int, replaced: bool) -> None:
        self.closed, self.ended_by = True, why
        self._pool._release(self._slot, why, retired=bool(flags & ss.RETIRED) or replaced)

    def __enter__(self) -> Session:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class SessionPool:
    """`num_slots` warm zygotes that host one tool session each (tier as `LocalSandboxPool`).

    Args:
      memory_mb: address-space limit of a session process.
      cpu_s: CPU seconds a session may use over its whole life (RLIMIT_CPU; passing it ends it).
    """

    def __init__(self, num_slots: int = 4, *, tier: str = "auto", memory_mb: int = 512,
                 cpu_s: float = 120.0, uid_base: int | None = None):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        if not isinstance(num_slots, int) or num_slots < 1:
            raise ValueError(f"num_slots must be a positive int, got {num_slots!r}")
        self.plan = probe(tier)
        self.tier, self.num_slots = self.plan.tier, num_slots
        self.memory_mb, self.cpu_s = int(memory_mb), float(cpu_s)
        self._cond = threading.Condition()
        self._free: collections.deque[int] = collections.deque()
        self._waiting: collections.deque[object] = collections.deque()
        self._closed = False
        self.opened, self.restarts, self.open_now = 0, 0, 0
        self.restart_failures = 0  # slots out of service: their zygote could not restart
        self.endings: collections.Counter = collections.Counter()
        self._stats = PoolStats()
        self._spawner = _Spawner()
        base = default_uid_base() + 1000 if uid_base is None else uid_base
        self._leases = [UidLease(base) if self.plan.root else None for _ in range(num_slots)]
        self._zygotes: list[_SessionZygote | None] = [None] * num_slots
        try:
            for i in range(num_slots):
                self._zygotes[i] = self._spawner.call(lambda i=i: self._start(i))
                self._free.append(i)
        except BaseException:
            self.close()
            raise

    def _start(self, i: int) -> _SessionZygote:
        lease = self._leases[i]
        return _SessionZygote(self.plan, lease.uid if lease else None)

    @property
    def slot_uids(self) -> list[int]:
        return [lease.uid for lease in self._leases if lease is not None]

    def open(self, timeout_s: float | None = None) -> Session:
        """A fresh session on the first free slot; waits first come, first served."""
        me, deadline = object(), None if timeout_s is None else time.monotonic() + timeout_s
        with self._cond:
            self._waiting.append(me)
            try:
                while not self._closed and not (self._free and self._waiting[0] is me):
                    left = None if deadline is None else deadline - time.monotonic()
                    if left is not None and left <= 0:
                        raise TimeoutError(f"no session slot free within {timeout_s} s")
                    self._cond.wait(left)
                if self._closed:
                    raise RuntimeError("SessionPool is closed")
                slot = self._free.popleft()
            finally:
                self._waiting.remove(me)
                self._cond.notify_all()
            self.open_now += 1
            self.opened += 1
        spec = dict(session="open", memory_mb=self.memory_mb, cpu_s=self.cpu_s)
        got = self._op(slot, spec, 10.0)
        session = Session(self, slot)
        if got is None or got[0] != "ok":
            session._end("killed", 0, replaced=True)
            raise RuntimeError(f"sandbox session could not open: {got}")
        return session

    def _op(self, slot: int, spec: dict, timeout_s: float) -> tuple | None:
        z = self._zygotes[slot]
        if z is None or not z.alive():
            return None
        return z.op(spec, timeout_s)

    def _record_call(self, r: ToolResult) -> None:
        self._stats.record(SandboxResult(r.status if r.status in ("ok", "error", "timeout")
                                         else "killed", None, "", "", r.wall_s, 0.0))

    def _release(self, slot: int, why: str, retired: bool) -> None:
        if retired:  # a broken zygote, or one that could not wipe: a fresh one on this slot
            old, self._zygotes[slot] = self._zygotes[slot], None
            if old is not None:
                old.kill()
                old.close(0)
            try:
                self._zygotes[slot] = self._spawner.call(lambda: self._start(slot))
            except Exception as e:  # noqa: BLE001 - the slot stays out of service
                log.error("sandbox session slot %d could not restart: %s", slot, e)
                slot = -1
        with self._cond:
            self.restart_failures += int(retired and slot < 0)
            self.restarts += int(retired)
            self.endings[why] += 1
            self.open_now -= 1
            if slot >= 0:
                self._free.append(slot)
            self._cond.notify_all()

    def stats(self) -> dict:
        """session_count (open now), opened, endings (closed / timeout / output_limit / exited /
        killed), restarts, restart_failures, and call counts and latency percentiles (s)."""
        with self._stats._lock:
            lat = [w for _, _, w in self._stats._lat]
        return dict(tier=self.tier, slots=self.num_slots, session_count=self.open_now,
                    opened=self.opened, endings=dict(self.endings), restarts=self.restarts,
                    restart_failures=self.restart_failures,
                    calls=self._stats.jobs, call_s_p50=_pct(lat, 0.5), call_s_p99=_pct(lat, 0.99),
                    ended_by_limit=sum(self.endings[k] for k in ENDINGS))

    def metrics(self) -> dict[str, float]:
        st = self.stats()
        return {"sandbox/session_count": st["session_count"],
                "sandbox/session_ended_by_limit": st["ended_by_limit"],
                "sandbox/session_restart_failures": float(st["restart_failures"])}

    def close(self) -> None:
        """Kills every session and zygote; later `open` calls fail."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        for i, z in enumerate(self._zygotes):
            if z is not None:
                z.kill()
                z.close(0)
                self._zygotes[i] = None
        self._spawner.stop()
        for lease in self._leases:
            if lease is not None:
                lease.release()

    def __enter__(self) -> SessionPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
