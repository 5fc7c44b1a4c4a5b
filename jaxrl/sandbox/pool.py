"""LocalSandboxPool: warm zygote sandboxes, one per slot, fed from one queue by one thread per slot.

    with LocalSandboxPool(num_workers=4) as pool:           # tier="auto" | "A" | "B"
        results = pool.run([SandboxJob(code="print(input())", stdin="hi")])
        future = pool.submit(jobs)                           # concurrent.futures.Future[list]
        pool.stats()                                         # tier, restarts, p50s, timeouts

The zygote lives in `zygote.py`, tier planning in `plan.py`. This module is the trusted side: it
picks the tier (a probe, logged), leases a non-root uid per slot when running as root, starts and
restarts zygotes, and measures queue wait, start latency and execution time separately. A job never
hangs the pool: the reply has a deadline, a dead or silent zygote is killed and replaced, and the
job reports "killed".
"""

from __future__ import annotations

import collections
import concurrent.futures
import logging
import marshal
import math
import os
import queue
import select
import subprocess
import tempfile
import threading
import time

from jaxrl.sandbox import zygote as sb
from jaxrl.sandbox.plan import (
    _PLANS,
    TierPlan,
    UidLease,
    default_uid_base,
    kill_uid,
    make_plan,
    zygote_command,
)
from jaxrl.sandbox.types import MAX_OUTPUT_CAP, SandboxJob, SandboxResult, validate_jobs

log = logging.getLogger(__name__)

TIERS = ("auto", "A", "B")
_READY_TIMEOUT_S = 20.0
_REPLY_GRACE_S = 10.0  # beyond the job's timeout: the zygote's own kill + sweep is bounded by ~5 s


# ----------------------------------------------------------------------------- one slot
class ZygoteProcess:
    """A started zygote: send one job spec, get one result back, with a deadline."""

    def __init__(self, plan: TierPlan, uid: int | None):
        argv, kw = zygote_command(plan, uid)
        self.plan, self.uid, self.failure = plan, uid, ""
        self._err = tempfile.TemporaryFile()  # bwrap's / the zygote's own complaints, if any
        # A process group of its own (same session: no scheduler autogroup of its own), so a
        # kill of the owner's group (a shell, a batch system) reaches the zygote only through
        # the owner's death, which it follows after killing the job tree.
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, close_fds=True, process_group=0, **kw)
        self._in, self._out = self.proc.stdin.fileno(), self.proc.stdout.fileno()
        ready = self._read_frame(time.monotonic() + _READY_TIMEOUT_S)
        if ready is None or not ready.startswith(sb.READY_MAGIC):
            self.kill()
            self._err.seek(0)
            why = self._err.read()[-2000:].decode("utf-8", "replace").strip()
            raise RuntimeError(f"sandbox zygote for tier {plan.tier} did not start (exit code "
                               f"{self.proc.poll()}): {why or 'no message'}; {plan.detail}")
        self.info = ready[len(sb.READY_MAGIC):].decode("utf-8", "replace")

    def _read_exact(self, n: int, deadline: float) -> bytes | None:
        buf = bytearray()
        while len(buf) < n:
            left = deadline - time.monotonic()
            if left <= 0 or not select.select([self._out], [], [], left)[0]:
                self.failure = "no answer"
                return None
            chunk = os.read(self._out, n - len(buf))
            if not chunk:
                self.failure = "died"
                return None
            buf += chunk
        return bytes(buf)

    def _read_frame(self, deadline: float) -> bytes | None:
        head = self._read_exact(4, deadline)
        if head is None:
            return None
        (n,) = sb.LEN.unpack(head)
        if n > 3 * MAX_OUTPUT_CAP:
            return None
        return self._read_exact(n, deadline)

    def run(self, job: SandboxJob) -> tuple | None:
        """(status, exit code, t_sent, t_started, t_end, stdout, stderr, retired) or None if it
        broke; `retired`: the zygote could not wipe what the job left and exits after this."""
        spec = dict(code=job.code, stdin=_as_bytes(job.stdin), timeout_s=float(job.timeout_s),
                    memory_mb=int(job.memory_mb), max_output_bytes=int(job.max_output_bytes),
                    files={k: _as_bytes(v) for k, v in job.files.items()})
        t_sent = time.monotonic()
        try:
            sb.write_frame(self._in, marshal.dumps(spec))
        except OSError:
            self.failure = "died"
            return None
        reply = self._read_frame(t_sent + job.timeout_s + _REPLY_GRACE_S)
        if reply is None or len(reply) < sb.RESULT_HEADER.size:
            return None
        st, flags, code, _t_recv, t_start, t_end, n_out, n_err = sb.RESULT_HEADER.unpack_from(reply)
        body = reply[sb.RESULT_HEADER.size:]
        if st >= len(sb.STATUSES) or n_out + n_err != len(body):
            return None
        out, err = body[:n_out], body[n_out:]
        return (sb.STATUSES[st], None if code == sb.NO_EXIT else code, t_sent, t_start, t_end,
                out.decode("utf-8", "replace"), err.decode("utf-8", "replace"),
                bool(flags & sb.RETIRED))

    def alive(self) -> bool:
        return self.proc.poll() is None

    def close(self, timeout: float = 2.0) -> None:
        try:
            self.proc.stdin.close()  # the zygote exits at EOF; in tier A its namespace goes with it
            self.proc.wait(timeout)
        except (OSError, subprocess.TimeoutExpired):
            self.kill()
        self.proc.stdout.close()
        self._err.close()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                log.error("sandbox zygote %d ignored SIGKILL", self.proc.pid)
        if self.uid is not None and self.plan.tier == "B":
            kill_uid(self.uid)  # a dead tier-B zygote's jobs are not in a pid namespace


def _as_bytes(value: str | bytes) -> bytes:
    return value.encode("utf-8") if isinstance(value, str) else bytes(value)


# ----------------------------------------------------------------------------- tier probe
_PROBE_LOCK = threading.Lock()
_PROBED: dict[str, TierPlan] = {}


def probe(tier: str = "auto") -> TierPlan:
    """Starts one zygote of the strongest tier allowed (or exactly `tier`), runs a job, logs the
    tier. Cached per process; raises RuntimeError naming why each candidate failed."""
    if tier not in TIERS:
        raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
    with _PROBE_LOCK:
        if tier in _PROBED:
            return _PROBED[tier]
        errors = []
        for candidate in ("A", "B") if tier == "auto" else (tier,):
            if candidate in _PROBED:
                _PROBED[tier] = _PROBED[candidate]
                return _PROBED[tier]
            lease = None
            try:
                plan = make_plan(candidate)
                _PLANS.append(plan)
                lease = UidLease() if plan.root else None
                z = ZygoteProcess(plan, lease.uid if lease else None)
                got = z.run(SandboxJob(code="print(6 * 7)", timeout_s=10))
                z.close()
                if got is None or got[0] != "ok" or got[5].strip() != "42":
                    raise RuntimeError(f"probe job failed: {got}")
                plan.detail = f"{plan.detail} [{z.info}]"
                log.info("sandbox: %s", plan.detail)
                _PROBED[candidate] = _PROBED[tier] = plan
                return plan
            except Exception as e:  # noqa: BLE001 - try the next tier, report all reasons
                errors.append(f"tier {candidate}: {e}")
                log.warning("sandbox tier %s unavailable: %s", candidate, e)
            finally:
                if lease:
                    lease.release()
        raise RuntimeError("no sandbox tier could start: " + "; ".join(errors))


# ----------------------------------------------------------------------------- stats
def _pct(values: list[float], q: float) -> float:
    if not values:
        return 0.0
    values = sorted(values)
    return values[min(len(values) - 1, max(0, math.ceil(q * len(values)) - 1))]


class PoolStats:
    """Counts and latency percentiles over the last `window` results."""

    def __init__(self, window: int = 4096):
        self._lock = threading.Lock()
        self._lat = collections.deque(maxlen=window)
        self.counts = collections.Counter()
        self.jobs = 0

    def record(self, r: SandboxResult) -> None:
        with self._lock:
            self._lat.append((r.queue_s, r.start_s, r.wall_s))
            self.counts[r.status] += 1
            self.jobs += 1

    def summary(self) -> dict:
        with self._lock:
            q, s, w = (list(x) for x in zip(*self._lat, strict=True)) if self._lat else ([], [], [])
            counts = dict(self.counts)
        return dict(jobs=self.jobs, statuses=counts, timeouts=counts.get("timeout", 0),
                    queue_wait_s_p50=_pct(q, 0.5), queue_wait_s_p99=_pct(q, 0.99),
                    start_s_p50=_pct(s, 0.5), start_s_p99=_pct(s, 0.99),
                    exec_s_p50=_pct(w, 0.5), exec_s_p99=_pct(w, 0.99))


def metrics(stats: dict) -> dict[str, float]:
    """The stable `sandbox/*` metric names (docs/metrics.md) from a `stats()` dict: restarts
    and restart_failures count since the pool started (a failed restart leaves its slot without
    a worker until the next job's retry)."""
    return {"sandbox/queue_wait_s_p50": stats["queue_wait_s_p50"],
            "sandbox/exec_s_p50": stats["exec_s_p50"], "sandbox/timeouts": stats["timeouts"],
            "sandbox/restarts": float(stats.get("restarts", 0)),
            "sandbox/restart_failures": float(stats.get("restart_failures", 0))}


# ----------------------------------------------------------------------------- the pool
class _Batch:
    def __init__(self, n: int, future: concurrent.futures.Future):
        self.results: list = [None] * n
        self.left, self.future, self._lock = n, future, threading.Lock()

    def set(self, i: int, result: SandboxResult) -> None:
        with self._lock:
            self.results[i] = result
            self.left -= 1
            done = self.left == 0
        if done and not self.future.done():
            self.future.set_result(self.results)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class _Slot:
    """One pool slot: a thread that owns (and replaces) one zygote. The zygote is started from this
    long-lived thread because its parent-death signal is tied to the thread that spawned it."""

    def __init__(self, pool: LocalSandboxPool, index: int):
        self.pool, self.index = pool, index
        self.lease = UidLease(pool.uid_base) if pool.plan.root else None
        self.zygote: ZygoteProcess | None = None
        self.error: BaseException | None = None
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self._loop, name=f"sandbox-slot-{index}", daemon=True)

    @property
    def uid(self) -> int | None:
        return self.lease.uid if self.lease else None

    def zygote_pids(self) -> list[int]:
        """Host pids of this slot's zygote: the started process and (tier A) the zygote in its
        pid namespace, last."""
        if self.zygote is None or not self.zygote.alive():
            return []
        pids = [self.zygote.proc.pid]
        try:
            with open(f"/proc/{pids[0]}/task/{pids[0]}/children") as f:
                pids += [int(p) for p in f.read().split()] if self.pool.tier == "A" else []
        except OSError:
            pass
        return pids

    def _loop(self) -> None:
        try:
            self.zygote = ZygoteProcess(self.pool.plan, self.uid)
        except BaseException as e:  # noqa: BLE001 - reported by the pool constructor
            self.error = e
        self.ready.set()
        while self.error is None:
            item = self.pool._queue.get()
            if item is None:
                break
            job, batch, i, t_enq = item
            try:
                result = self._run(job, t_enq)
            except BaseException as e:  # noqa: BLE001 - a pool bug must not lose the job
                log.exception("sandbox slot %d failed", self.index)
                result = SandboxResult("killed", None, "", f"sandbox pool error: {e!r}", 0.0, 0.0)
            self.pool._stats.record(result)
            batch.set(i, result)
        if self.zygote is not None:
            self.zygote.close()
        if self.lease:
            self.lease.release()

    def _run(self, job: SandboxJob, t_enq: float) -> SandboxResult:
        t0 = time.monotonic()
        if self.zygote is None or not self.zygote.alive():  # died while idle: replace it first
            self._replace()
        got = self.zygote.run(job) if self.zygote is not None else None
        if got is None and self.zygote is not None and self.zygote.failure == "died":
            self._replace()  # it died (the job may not have reached it): one more try, fresh
            got = self.zygote.run(job) if self.zygote is not None else None
        if got is None:
            why = self.zygote.failure if self.zygote is not None else "could not start"
            if self.zygote is not None:
                self._replace()
            return SandboxResult("killed", None, "", f"sandbox worker {why} during this job; it "
                                 "was replaced", wall_s=time.monotonic() - t0, queue_s=t0 - t_enq)
        status, code, t_sent, t_start, t_end, out, err, retired = got
        if retired:  # fresh scratch space before the next job: a new zygote
            log.warning("sandbox slot %d: the job left files the wipe could not remove; "
                        "replacing the zygote", self.index)
            with self.pool._lock:
                self.pool.scratch_retired += 1
            self._replace()
        return SandboxResult(status, code, out, err, wall_s=max(0.0, t_end - t_start),
                             queue_s=t0 - t_enq, start_s=max(0.0, t_start - t_sent))

    def _replace(self) -> None:
        with self.pool._lock:
            self.pool.restarts += 1
        if self.zygote is not None:
            self.zygote.kill()
            self.zygote.close(0)
        self.zygote = None
        for attempt in range(3):
            try:
                self.zygote = ZygoteProcess(self.pool.plan, self.uid)
                return
            except Exception as e:  # noqa: BLE001 - next job retries
                with self.pool._lock:
                    self.pool.restart_failures += 1
                log.error("sandbox slot %d: restart %d failed: %s", self.index, attempt, e)
                time.sleep(0.2 * (attempt + 1))


class LocalSandboxPool:
    """Sandboxed Python execution on this machine: `num_workers` warm zygotes (default: one per
    CPU this process may use). `tier` is "auto" (strongest available), "A" or "B"."""

    def __init__(self, num_workers: int | None = None, *, tier: str = "auto",
                 uid_base: int | None = None, stats_window: int = 4096):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        n = len(os.sched_getaffinity(0)) if num_workers is None else num_workers
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_workers must be a positive int or None, got {num_workers!r}")
        self.plan = probe(tier)
        self.tier, self.tier_detail, self.num_workers = self.plan.tier, self.plan.detail, n
        self.uid_base = default_uid_base() if uid_base is None else uid_base
        self.restarts, self.scratch_retired, self.restart_failures = 0, 0, 0
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._stats = PoolStats(stats_window)
        self._closed = False
        self._slots = [_Slot(self, i) for i in range(n)]
        for s in self._slots:
            s.thread.start()
        for s in self._slots:
            s.ready.wait(_READY_TIMEOUT_S + 5)
        errors = [s.error or "no answer" for s in self._slots if s.error or not s.ready.is_set()]
        if errors:
            self.close()
            raise RuntimeError(f"sandbox pool could not start {len(errors)} of {n} workers: "
                               f"{errors[0]}")

    @property
    def slot_uids(self) -> list[int]:
        """The per-slot uids jobs run as (empty when the pool is not root)."""
        return [s.uid for s in self._slots if s.uid is not None]

    def submit(self, jobs: list[SandboxJob]) -> concurrent.futures.Future:
        """Queues `jobs`; the future resolves to their results, in order."""
        jobs = validate_jobs(jobs)
        future: concurrent.futures.Future = concurrent.futures.Future()
        future.set_running_or_notify_cancel()
        if self._closed:
            raise RuntimeError("LocalSandboxPool is closed")
        if not jobs:
            future.set_result([])
            return future
        batch, now = _Batch(len(jobs), future), time.monotonic()
        for i, job in enumerate(jobs):
            self._queue.put((job, batch, i, now))
        return future

    def run(self, jobs: list[SandboxJob]) -> list[SandboxResult]:
        """Runs `jobs` and returns their results in order (blocking)."""
        return self.submit(jobs).result()

    def stats(self) -> dict:
        """tier, workers, restarts (zygotes replaced, for any reason), scratch_retired (of those,
        replaced because a job left files the wipe could not remove), restart_failures (attempts
        to start a replacement that failed), jobs, status counts, timeouts, and p50/p99 of queue
        wait, start latency and execution time (seconds) over the last `stats_window` jobs."""
        return dict(tier=self.tier, tier_detail=self.tier_detail, workers=self.num_workers,
                    restarts=self.restarts, scratch_retired=self.scratch_retired,
                    restart_failures=self.restart_failures, **self._stats.summary())

    def metrics(self) -> dict[str, float]:
        return metrics(self.stats())

    def close(self) -> None:
        """Stops the workers after the jobs already running; queued jobs fail; no process stays."""
        if self._closed:
            return
        self._closed = True
        while True:
            try:
                item = self._queue.get_nowait()
            except queue.Empty:
                break
            item[1].fail(RuntimeError("LocalSandboxPool closed before the job ran"))
        for _ in self._slots:
            self._queue.put(None)
        for s in self._slots:
            if s.thread.is_alive():
                s.thread.join()

    def __enter__(self) -> LocalSandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

