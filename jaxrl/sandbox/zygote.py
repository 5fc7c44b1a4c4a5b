"""Sandbox isolation: the warm fork-server ("zygote") that runs untrusted jobs, and its wire format.

This file, `syscalls.py` and `zygote_session.py` are stdlib-only and are ALSO the zygote program:
the pool runs `python -I -S -c <zygote_program()> zygote <config json>` (inside bubblewrap in tier
A), where the program carries their sources, so nothing here may import jaxrl, jax or numpy.

Tiers (strongest first; `jaxrl.sandbox.pool.probe` picks one, `plan.make_plan` plans it):
  A  bubblewrap: user/pid/net/ipc/uts namespaces, read-only binds of the runtime only, a read-only
     /dev, a size-capped private /tmp and /dev/shm, empty environment, the zygote as PID 1 of the
     pid namespace. When the pool runs as root, bwrap is started as a per-slot unprivileged uid
     (root stays root outside).
  B  no user namespaces: the zygote drops each job to the slot's uid (when root), applies rlimits
     and the seccomp filter; leftovers are swept by uid (root) or as reparented children.
Both tiers: seccomp (see `syscalls.seccomp_program`), no_new_privs; the zygote is not
dumpable (jobs cannot ptrace it).

Per job the zygote forks a child (setsid, rlimits AS/CPU/FSIZE/NOFILE/NPROC/CORE, private job dir,
stdin from a memfd, stdout/stderr to pipes) that compiles and runs the job's source under those
limits; the zygote only waits on a pidfd with a wall-clock deadline, reads at most
`max_output_bytes` per stream, never waits for pipe EOF, then kills every process the job left and
wipes what it wrote (a removal no permission bit or depth can stop). If anything remains, the
reply says so and the zygote exits after it: the pool replaces it, with fresh scratch space. If
the pool's end of the command pipe closes (the owner died), the zygote kills the job tree and exits.
"""

import os
import struct
import sys
from time import monotonic as _now
from time import sleep as _sleep

if __package__:  # imported by the trusted side as jaxrl.sandbox.zygote
    from . import syscalls, zygote_session
else:  # the zygote program: `zygote_program` loaded them as top-level modules first
    import syscalls
    import zygote_session

# ----------------------------------------------------------------------------- wire format
STATUSES = ("ok", "error", "timeout", "oom", "killed", "output_limit")
OOM_EXIT = 251  # exit code the child uses after an uncaught MemoryError
READY_MAGIC = b"JXZ1"
# result header: status index, flags, exit code (NO_EXIT: none), t_recv, t_started, t_end,
# len out/err
RESULT_HEADER = struct.Struct("<BBiddd II")
RETIRED = 1  # flag: the job left what the wipe could not remove; the zygote exits after replying
NO_EXIT = -(2**31)
LEN = struct.Struct("<I")


def read_exact(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError(f"pipe closed after {len(buf)} of {n} bytes")
        buf += chunk
    return bytes(buf)


def write_frame(fd: int, payload: bytes) -> None:
    data = memoryview(LEN.pack(len(payload)) + payload)
    while data:
        data = data[os.write(fd, data) :]


def check_job_path(name: str) -> str:
    """A job file name must be relative, without '..', NUL or empty parts."""
    parts = name.split("/")
    if not name or name.startswith("/") or "\0" in name or any(p in ("", ".", "..") for p in parts):
        raise ValueError(f"job file name {name!r} must be a relative path without '.', '..' "
                         "or '//'")
    return name


# ----------------------------------------------------------------------------- the zygote
class Zygote:
    """Runs inside the sandbox: reads job specs on fd 0, answers on fd 1, one job at a time."""

    PREFIX_FD = 9  # tier B as root: O_PATH fd of the Python prefix (the job uid may not reach it)

    def __init__(self, cfg: dict):
        import marshal
        import resource
        import select
        import signal
        import traceback

        self.cfg = cfg
        self.marshal, self.resource, self.select = marshal, resource, select
        self.signal, self.traceback = signal, traceback
        self.uid, self.gid = cfg.get("uid", -1), cfg.get("gid", -1)
        self.pid1 = os.getpid() == 1
        self.notes = [f"tier={cfg['tier']}", f"pid={os.getpid()}", f"uid={os.getuid()}"]
        for name in cfg.get("preimport", ()):
            try:
                __import__(name)
            except Exception:  # noqa: BLE001 - a missing optional module is not an error
                pass
        if self.pid1:  # tier A: the pid namespace (every job process) dies with us
            syscalls.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
        else:  # the owner died: kill the job tree, then exit (the jobs are in no namespace)
            signal.signal(signal.SIGTERM, self.owner_gone)
            syscalls.prctl(1, signal.SIGTERM)
            if os.getppid() != cfg.get("owner", os.getppid()):
                os._exit(3)  # the pool died before we set the death signal
        syscalls.prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of a job come back to us
        if cfg.get("private_mounts"):  # tier B as root: before seccomp, which denies mount
            try:
                syscalls.private_mounts(**cfg["private_mounts"])
                cfg.update(jobdir="/tmp/job", sweep_owned=[], prefix_fd_path=None,
                           wipe=["/tmp", "/var/tmp", "/dev/shm", *cfg.get("wipe", ())])
                self.notes.append("private mounts: read-only host, own /tmp /dev/shm, hidepid")
            except OSError as e:
                self.notes.append(f"no private mounts ({e}): sweeping /tmp, /var/tmp, /dev/shm")
        self.sys_path = list(sys.path)
        if cfg.get("prefix_fd_path"):  # the job uid cannot reach the interpreter: import via fd
            fd = os.open(cfg["prefix_fd_path"], os.O_PATH | os.O_DIRECTORY)
            os.dup2(fd, self.PREFIX_FD, inheritable=True)
            os.close(fd)
            pre, via = cfg["prefix_fd_path"].rstrip("/"), f"/proc/self/fd/{self.PREFIX_FD}"
            self.sys_path = [via + p[len(pre):] if p.startswith(pre) else p for p in sys.path]
        syscalls.prctl(4, 0)  # not dumpable: jobs (same uid in tier A) cannot ptrace us
        if cfg.get("seccomp", True):
            try:
                self.notes.append(syscalls.apply_seccomp(cfg.get("allow_unix_sockets", False)))
            except (OSError, ValueError) as e:
                self.notes.append(f"seccomp unavailable: {e}")
        if self.uid >= 0:
            self.notes.append(f"jobs run as uid {self.uid}")
        os.environ.clear()  # jobs inherit this environment; the zygote started with an empty one
        os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", HOME=cfg["jobdir"],
                          TMPDIR=cfg["jobdir"], LANG="C.UTF-8", PYTHONIOENCODING="utf-8")
        sys.path[:] = self.sys_path
        self.devnull = os.open(os.devnull, os.O_RDONLY)
        self.owned_dirs = [d for d in cfg.get("sweep_owned", ()) if os.path.isdir(d)]
        self.mtimes: list[int] = []
        # What the scratch dirs hold before any job (tier A's /dev: its device nodes) and their
        # modes: after each job everything else goes, and the modes come back.
        self.scratch = {d: frozenset(os.listdir(d)) for d in cfg.get("wipe", ())
                        if os.path.isdir(d)}
        parent = os.path.dirname(cfg["jobdir"])  # a job of our uid may lock it too
        self.meta = {d: _meta(d) for d in (*self.scratch, parent) if os.path.isdir(d)}
        self.leftovers: list[str] = []
        self.sessions = None  # the open session's host, once a session op arrived
        # Made once here, used by every child after its dup2s (the zygote never writes to them).
        self.stdio = (open(0, encoding="utf-8", errors="replace", closefd=False),
                      open(1, "w", encoding="utf-8", errors="backslashreplace", closefd=False),
                      open(2, "w", encoding="utf-8", errors="backslashreplace", closefd=False))
        import gc
        import mmap

        self.started = mmap.mmap(-1, 8)  # shared page: the child's start time, without a syscall
        self.gc = gc
        gc.collect()
        gc.freeze()  # children do not walk (and copy-on-write) the zygote's heap when they collect
        gc.disable()

    # -- main loop
    def serve(self) -> None:
        write_frame(1, READY_MAGIC + "; ".join(self.notes).encode())
        while True:
            try:
                (n,) = LEN.unpack(read_exact(0, 4))
                spec = self.marshal.loads(read_exact(0, n))
            except EOFError:
                return
            t_recv = _now()
            if "session" in spec:  # a stateful session (zygote_session.py); same isolation
                write_frame(1, self.session_op(spec))
                if self.leftovers:
                    return
                continue
            self.mtimes = [_mtime(d) for d in self.owned_dirs]
            status, code, t_start, t_end, out, err = self.run_job(spec)
            left = self.leftovers
            header = RESULT_HEADER.pack(STATUSES.index(status), RETIRED if left else 0,
                                        NO_EXIT if code is None else code, t_recv, t_start, t_end,
                                        len(out), len(err))
            write_frame(1, header + out + err)
            if left:  # the pool replaces us: a fresh zygote, fresh scratch space
                _try_write(2, f"sandbox: retiring; the wipe left {left[:3]}\n".encode())
                return

    def session_op(self, spec: dict) -> bytes:
        if self.sessions is None:
            self.sessions = zygote_session.SessionHost(self, sys.modules[__name__])
        return self.sessions.handle(spec)

    def owner_gone(self, *_) -> None:
        """The pool's owner died (parent-death signal, or the command pipe closed mid-job)."""
        try:
            self.sweep()
        finally:
            os._exit(0)

    def run_job(self, spec: dict):
        jobdir = self.cfg["jobdir"]
        try:
            os.mkdir(jobdir, 0o700)
        except FileExistsError:  # left by a zygote that died mid-job
            self.wipe(jobdir)
            os.mkdir(jobdir, 0o700)
        if self.uid >= 0:
            os.chown(jobdir, self.uid, self.gid)
        out_r, out_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        err_r, err_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        struct.pack_into("d", self.started, 0, 0.0)
        t_fork = _now()
        pid = os.fork()
        if pid == 0:
            self.child(spec, jobdir, out_w, err_w)  # never returns
        for fd in (out_w, err_w):
            os.close(fd)
        try:
            result = self.supervise(pid, spec, out_r, err_r, t_fork)
        finally:
            for fd in (out_r, err_r):
                os.close(fd)
            self.sweep()
            self.wipe(jobdir)
        return result

    def supervise(self, pid, spec, out_r, err_r, t_fork):
        cap, deadline = spec["max_output_bytes"], t_fork + spec["timeout_s"]
        bufs = {out_r: bytearray(), err_r: bytearray()}
        poller = self.select.poll()
        try:
            pidfd = os.pidfd_open(pid)
        except OSError:
            pidfd = None
        for fd in (out_r, err_r) + ((pidfd,) if pidfd is not None else ()):
            poller.register(fd, self.select.POLLIN)
        poller.register(0, self.select.POLLIN)  # the pool never writes during a job: EOF only
        limit, exited, reaped = None, False, None
        while not exited:
            left = deadline - _now()
            if left <= 0:
                limit = "timeout"
                break
            wait_ms = left * 1000 if pidfd is not None else min(left * 1000, 2)
            for fd, _ in poller.poll(max(1, int(wait_ms + 0.999))):
                if fd == pidfd:
                    exited = True
                elif fd == 0:  # the owner died: take the job tree with us
                    self.owner_gone()
                elif not self.pump(fd, bufs[fd], cap, poller):
                    limit = "output_limit"
            if limit:
                break
            if pidfd is None:
                done, st = os.waitpid(pid, os.WNOHANG)
                exited, reaped = done == pid, (st if done == pid else None)
        if pidfd is not None:
            os.close(pidfd)
        if limit:
            _kill(-pid)
            _kill(pid)
        wstatus = reaped if reaped is not None else os.waitpid(pid, 0)[1]
        for fd, buf in bufs.items():  # what is already in the pipes, without waiting for EOF
            if len(buf) <= cap and not self.pump(fd, buf, cap, None, drain=True):
                limit = limit or "output_limit"
        t_end = _now()
        t_start = struct.unpack_from("d", self.started)[0]  # written by the child (clamped: it
        t_start = min(max(t_start, t_fork), t_end)  # is in the job's memory, a metric only)
        out, err = bytes(bufs[out_r][:cap]), bytes(bufs[err_r][:cap])
        if limit:
            return limit, None, t_start, t_end, out, err
        return (*_classify(wstatus), t_start, t_end, out, err)

    @staticmethod
    def pump(fd, buf, cap, poller, drain=False) -> bool:
        """Reads what is available from `fd`; False when the stream went over `cap`."""
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                return True
            if not chunk:
                if poller is not None:
                    poller.unregister(fd)
                return True
            buf += chunk
            if len(buf) > cap:
                return False
            if not drain:
                return True

    # -- after each job
    def sweep(self) -> None:
        """Kills and reaps every process the job left (all are our descendants: subreaper)."""
        t_give_up = _now() + 5.0
        while True:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid:
                continue
            if _now() > t_give_up:
                return  # unkillable (D state); the next job still runs
            if self.pid1:
                _kill(-1)  # from PID 1 of the namespace: everything but us
            elif self.uid >= 0:
                self.kill_uid()
            else:
                self.kill_children()
            _sleep(0.0005)

    def kill_uid(self) -> None:
        pid = os.fork()
        if pid == 0:
            try:
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
                os.kill(-1, 9)  # every process of the slot uid, atomically, except this one
            finally:
                os._exit(0)
        os.waitpid(pid, 0)

    @staticmethod
    def kill_children() -> None:
        me = os.getpid()
        try:
            with open(f"/proc/{me}/task/{me}/children") as f:
                pids = [int(p) for p in f.read().split()]
        except OSError:
            pids = []
        for p in pids:
            _kill(-p)
            _kill(p)

    def wipe(self, jobdir: str) -> None:
        """Removes the job dir and everything new in the scratch dirs, whatever modes or depth
        the job left; `self.leftovers` lists what could not be removed (then we retire)."""
        left = []
        for d, meta in self.meta.items():  # a job of our uid (tier A) may lock or mark them
            try:
                _restore_meta(d, meta)
            except OSError:
                left.append(f"{d} (mode, times or xattrs)")
        try:
            os.rmdir(jobdir)  # the common case: the job left nothing
        except FileNotFoundError:
            pass
        except OSError:
            parent, name = os.path.split(jobdir)
            try:
                fd = os.open(parent, os.O_RDONLY | os.O_DIRECTORY)
                try:
                    syscalls.remove_entry(fd, name)
                finally:
                    os.close(fd)
            except OSError:
                pass
        left += [jobdir] if os.path.lexists(jobdir) else []
        for d, keep in self.scratch.items():  # the private /tmp, /dev/shm (and /dev)
            left += syscalls.empty_dir(d, keep)
        for d, before in zip(self.owned_dirs, self.mtimes, strict=False):
            if _mtime(d) != before:  # tier B: what the slot uid left in the host's /tmp etc.
                left += self.remove_owned(d)
        self.leftovers = left

    def remove_owned(self, d: str) -> list[str]:
        left = []
        try:
            fd = os.open(d, os.O_RDONLY | os.O_DIRECTORY)
        except OSError:
            return []
        try:
            for entry in os.scandir(fd):
                try:
                    if entry.stat(follow_symlinks=False).st_uid == self.uid:
                        syscalls.remove_entry(fd, entry.name)
                except OSError:
                    left.append(f"{d}/{entry.name}")
        finally:
            os.close(fd)
        return left

    # -- the job process
    def child(self, spec, jobdir, out_w, err_w, extra_fds=(), body=None):
        """The job process: limits, uid, stdio, then `spec["code"]` (or `body()`, a session's
        loop, with `extra_fds` as fds 3, 4, ...)."""
        code = 1
        try:
            self.signal.signal(self.signal.SIGTERM, self.signal.SIG_DFL)
            os.setsid()
            if self.uid >= 0:
                os.setgroups([])
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
                if self.cfg.get("prefix_fd_path"):
                    syscalls.prctl(4, 1)  # dumpable again, so /proc/self/fd works for the prefix fd
            if not self.pid1:  # no pid namespace: die with the zygote (set after the uid change,
                syscalls.prctl(1, self.signal.SIGKILL)  # which clears it)
            res, timeout = self.resource, spec["timeout_s"]
            cpu = int(timeout) + 1
            mem = spec["memory_mb"] << 20
            fsize = self.cfg.get("fsize_mb", 64) << 20
            for lim, val in ((res.RLIMIT_CORE, (0, 0)), (res.RLIMIT_CPU, (cpu, cpu + 1)),
                             (res.RLIMIT_FSIZE, (fsize, fsize)),
                             (res.RLIMIT_NOFILE, (self.cfg.get("nofile", 256),) * 2),
                             (res.RLIMIT_AS, (mem, mem))):
                res.setrlimit(lim, val)
            if self.cfg.get("nproc"):  # only with a dedicated uid: NPROC counts the whole uid
                res.setrlimit(res.RLIMIT_NPROC, (self.cfg["nproc"],) * 2)
            os.chdir(jobdir)
            for name, content in spec["files"].items():
                check_job_path(name)
                if "/" in name:
                    os.makedirs(os.path.dirname(name), exist_ok=True)
                fd = os.open(name, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
                with open(fd, "wb") as f:
                    f.write(content)
            stdin = os.memfd_create("stdin") if spec["stdin"] else self.devnull
            if spec["stdin"]:
                os.write(stdin, spec["stdin"])
                os.lseek(stdin, 0, os.SEEK_SET)
            high = [syscalls.dup_above(fd, 64) for fd in extra_fds]  # out of the dup2s' way
            for src, dst in ((stdin, 0), (out_w, 1), (err_w, 2), *zip(high, (3, 4), strict=False)):
                os.dup2(src, dst, inheritable=True)
            os.set_blocking(1, True)
            os.set_blocking(2, True)
            keep = self.PREFIX_FD if self.cfg.get("prefix_fd_path") else None
            os.closerange(3 + len(high), keep or 65536)
            if keep:
                os.closerange(keep + 1, 65536)
            sys.stdin, sys.stdout, sys.stderr = self.stdio
            sys.argv = ["<job>"]
            self.gc.enable()
            struct.pack_into("d", self.started, 0, _now())
            self.started.close()
            if body is not None:
                body()
            else:
                # Compiled here, under the job's limits: a source that is costly to compile
                # (e.g. 3 MB of list literal: ~1 GB) is the job's problem, not the zygote's.
                compiled = compile(spec["code"], "<job>", "exec", dont_inherit=True)
                exec(compiled, {"__name__": "__main__", "__builtins__": __builtins__})
            code = 0
        except SystemExit as e:
            code = _exit_code(e.code)
        except MemoryError:
            _try_write(2, b"MemoryError\n")
            code = OOM_EXIT
        except BaseException:  # noqa: BLE001 - report everything the job raised
            try:
                kind, value, tb = sys.exc_info()
                self.traceback.print_exception(kind, value, tb.tb_next if tb else None)
            except BaseException:  # noqa: BLE001
                _try_write(2, b"job raised an exception\n")
            code = 1
        finally:
            for stream in (sys.stdout, sys.stderr):
                try:
                    stream.flush()
                except BaseException:  # noqa: BLE001
                    pass
            os._exit(code)


def _exit_code(value) -> int:
    if value is None:
        return 0
    if isinstance(value, int):
        return value & 0xFF
    _try_write(2, (str(value) + "\n").encode("utf-8", "replace"))
    return 1


def _classify(wstatus: int) -> tuple[str, int | None]:
    if os.WIFEXITED(wstatus):
        code = os.WEXITSTATUS(wstatus)
        return ("ok" if code == 0 else "oom" if code == OOM_EXIT else "error"), code
    sig = os.WTERMSIG(wstatus) if os.WIFSIGNALED(wstatus) else 0
    if sig == 24:  # SIGXCPU: the CPU-time rlimit
        return "timeout", -sig
    if sig == 25:  # SIGXFSZ: a file over the size limit
        return "output_limit", -sig
    return "killed", -sig


def _kill(pid: int) -> None:
    try:
        os.kill(pid, 9)
    except (ProcessLookupError, PermissionError):
        pass


def _try_write(fd: int, data: bytes) -> None:
    try:
        os.write(fd, data)
    except OSError:
        pass


def _mtime(path: str) -> int:
    try:
        return os.stat(path).st_mtime_ns
    except OSError:
        return 0


def _meta(path: str) -> tuple:
    """What a job that owns directory `path` could change on it and a later job could read."""
    st = os.stat(path)
    xattrs = {}
    try:
        for name in os.listxattr(path):
            xattrs[name] = os.getxattr(path, name)
    except OSError:
        pass
    return st.st_mode, st.st_atime_ns, st.st_mtime_ns, xattrs


def _restore_meta(path: str, meta: tuple) -> None:
    """Puts back mode, xattrs, and times (a 128-bit message for the next job otherwise)."""
    mode, atime, mtime, xattrs = meta
    st = os.stat(path)
    if st.st_mode != mode:
        os.chmod(path, mode)
    try:
        names = os.listxattr(path)
    except OSError:
        names = []
    for name in names:
        if name not in xattrs:
            os.removexattr(path, name)
    for name, value in xattrs.items():
        if name not in names or os.getxattr(path, name) != value:
            os.setxattr(path, name, value)
    if (st.st_atime_ns, st.st_mtime_ns) != (atime, mtime):
        os.utime(path, ns=(atime, mtime))


def zygote_program() -> str:
    """The `python -c` program of a zygote: it loads `syscalls.py`, `zygote_session.py`, then this
    file, each as a top-level module from its source text (the sandbox may not reach these files),
    and runs `_main` on its arguments."""
    if not _PROGRAM:
        here = os.path.dirname(os.path.abspath(__file__))
        srcs = []
        for name in ("syscalls", "zygote_session", "zygote"):
            with open(os.path.join(here, name + ".py"), encoding="utf-8") as f:
                srcs.append((name, f.read()))
        _PROGRAM.append("import sys, types\n"
                        f"for _n, _s in {srcs!r}:\n"
                        "    _m = sys.modules[_n] = types.ModuleType(_n)\n"
                        "    exec(compile(_s, _n + '.py', 'exec'), _m.__dict__)\n"
                        "sys.modules['zygote']._main(sys.argv[1:])\n")
    return _PROGRAM[0]


_PROGRAM: list[str] = []


def _main(argv: list[str]) -> None:
    import json

    mode, cfg = argv[0], json.loads(argv[1])
    if mode == "zygote":
        Zygote(cfg).serve()
    elif mode == "launch":
        syscalls.launch(cfg)
    else:
        raise SystemExit(f"sandbox: unknown mode {mode!r}; valid: zygote, launch")


if __name__ == "__main__":
    _main(sys.argv[1:])
