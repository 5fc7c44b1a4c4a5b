"""Sandbox isolation: the warm fork-server ("zygote") and the tier plan that starts it.

This file is stdlib-only and is ALSO the zygote program: the pool runs its source with
`python -I -S -c <this file> zygote <config json>` (inside bubblewrap in tier A), so nothing here
may import jaxrl, jax or numpy at module level.

Tiers (strongest first; `plan_tier` probes and picks):
  A  bubblewrap: user/pid/net/ipc/uts namespaces, read-only binds of the runtime only, a size-capped
     private /tmp and /dev/shm, empty environment, the zygote as PID 1 of the pid namespace. When
     the pool runs as root, bwrap is started as a per-slot unprivileged uid (root stays root
     outside).
  B  no user namespaces: the zygote drops each job to the slot's uid (when root), applies rlimits
     and the seccomp filter; leftovers are swept by uid (root) or as reparented children.
Both tiers: seccomp denies inet sockets, ptrace, unshare/setns/mount, namespace clones, io_uring,
bpf, keyrings, module loading; no_new_privs; the zygote is not dumpable (jobs cannot ptrace it).

Per job the zygote forks a child (setsid, rlimits AS/CPU/FSIZE/NOFILE/NPROC/CORE, private job dir,
stdin from a memfd, stdout/stderr to pipes), waits on a pidfd with a wall-clock deadline, reads at
most `max_output_bytes` per stream, never waits for pipe EOF, then kills every process the job left
and wipes the job's files.
"""

from __future__ import annotations

import os
import struct
import sys
from time import monotonic as _now
from time import sleep as _sleep

# ----------------------------------------------------------------------------- wire format
STATUSES = ("ok", "error", "timeout", "oom", "killed", "output_limit")
OOM_EXIT = 251  # exit code the child uses after an uncaught MemoryError
READY_MAGIC = b"JXZ1"
# result header: status index, exit code (NO_EXIT: none), t_recv, t_started, t_end, len out/err
RESULT_HEADER = struct.Struct("<Biddd II")
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


# ----------------------------------------------------------------------------- seccomp (BPF)
_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_DENY_NRS = {  # syscall numbers denied with EPERM, per arch
    "x86_64": dict(
        ptrace=101, process_vm_readv=310, process_vm_writev=311, mount=165, umount2=166,
        pivot_root=155, chroot=161, unshare=272, setns=308, keyctl=250, add_key=248,
        request_key=249, bpf=321, perf_event_open=298, userfaultfd=323, io_uring_setup=425,
        io_uring_enter=426, io_uring_register=427, open_by_handle_at=304, name_to_handle_at=303,
        init_module=175, finit_module=313, delete_module=176, kexec_load=246, kexec_file_load=320,
        open_tree=428, move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433,
        mount_setattr=442, acct=163, swapon=167, swapoff=168, reboot=169, sethostname=170,
        setdomainname=171, iopl=172, ioperm=173, shmget=29, shmat=30, shmctl=31, semget=64,
        semop=65, semctl=66, shmdt=67, msgget=68, msgsnd=69, msgrcv=70, msgctl=71,
        semtimedop=220, mq_open=240,
    ),
    "aarch64": dict(
        ptrace=117, process_vm_readv=270, process_vm_writev=271, mount=40, umount2=39,
        pivot_root=41, chroot=51, unshare=97, setns=268, keyctl=219, add_key=217, request_key=218,
        bpf=280, perf_event_open=241, userfaultfd=282, io_uring_setup=425, io_uring_enter=426,
        io_uring_register=427, open_by_handle_at=265, name_to_handle_at=264, init_module=105,
        finit_module=273, delete_module=106, kexec_load=104, kexec_file_load=294, open_tree=428,
        move_mount=429, fsopen=430, fsconfig=431, fsmount=432, fspick=433, mount_setattr=442,
        acct=89, swapon=224, swapoff=225, reboot=142, sethostname=161, setdomainname=162,
        msgget=186, msgctl=187, msgrcv=188, msgsnd=189, semget=190, semctl=191, semtimedop=192,
        semop=193, shmget=194, shmctl=195, shmat=196, shmdt=197, mq_open=180,
    ),
}
_SOCKET_NR = {"x86_64": 41, "aarch64": 198}
_CLONE_NR = {"x86_64": 56, "aarch64": 220}
_CLONE3_NR = 435
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
_CLONE_NS_FLAGS |= 0x40000000 | 0x00000080


def seccomp_program(arch: str, allow_unix_sockets: bool) -> bytes:
    """The BPF filter (struct sock_filter[]) for `arch`; raises ValueError for an unknown arch."""
    if arch not in _AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for arch {arch!r}; known: {sorted(_AUDIT_ARCH)}")
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    ins: list[tuple] = [(ld, 0, 0, 4), (jeq, 0, "kill", _AUDIT_ARCH[arch]), (ld, 0, 0, 0)]
    if arch == "x86_64":
        ins.append((jge, "deny", 0, 0x40000000))  # the x32 ABI
    ins += [(jeq, "deny", 0, nr) for nr in sorted(_DENY_NRS[arch].values())]
    ins += [
        (jeq, "socket", 0, _SOCKET_NR[arch]),
        (jeq, "clone", 0, _CLONE_NR[arch]),
        (jeq, "enosys", 0, _CLONE3_NR),  # clone3 args live in memory: make libc fall back to clone
        (ret, 0, 0, 0x7FFF0000),
    ]
    labels = {"socket": len(ins)}
    ins += [(ld, 0, 0, 16), (jeq, "allow" if allow_unix_sockets else "deny", "deny", 1)]  # AF_UNIX
    labels["clone"] = len(ins)
    ins += [(ld, 0, 0, 16), (jset, "deny", "allow", _CLONE_NS_FLAGS)]
    for name, action in (("deny", 0x00050000 | 1), ("enosys", 0x00050000 | 38),
                         ("kill", 0x80000000), ("allow", 0x7FFF0000)):
        labels[name] = len(ins)
        ins.append((ret, 0, 0, action))
    out = bytearray()
    for i, (code, jt, jf, k) in enumerate(ins):
        jt = labels[jt] - i - 1 if isinstance(jt, str) else jt
        jf = labels[jf] - i - 1 if isinstance(jf, str) else jf
        out += struct.pack("<HBBI", code, jt, jf, k)
    return bytes(out)


_LIBC: list = []


def _libc():
    if not _LIBC:
        import ctypes

        _LIBC.extend((ctypes, ctypes.CDLL(None, use_errno=True)))
    return _LIBC[0], _LIBC[1]


def apply_seccomp(allow_unix_sockets: bool) -> str:
    """Sets no_new_privs and installs the filter on this process (inherited by its children)."""
    import platform

    ctypes, libc = _libc()
    prog = seccomp_program(platform.machine(), allow_unix_sockets)
    if libc.prctl(38, 1, 0, 0, 0) != 0:  # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    buf = ctypes.create_string_buffer(prog)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_SECCOMP) failed")
    return f"seccomp({len(prog) // 8} insns)"


def private_mounts(tmp_mb: int, shm_mb: int, expose: tuple = ()) -> None:
    """Root without user namespaces: a private mount namespace where every host filesystem is
    read-only and /tmp, /var/tmp, /dev/shm are fresh size-capped tmpfs (so a job can neither
    leave files on the host nor see another slot's), and /proc shows a job only its own
    processes (hidepid). Each `expose` path (the interpreter's
    prefix) is made reachable by covering its first untraversable ancestor (e.g. a 0700 /root)
    with an empty tmpfs and binding the path back: the rest of that ancestor stays hidden."""
    ctypes, libc = _libc()

    def check(rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, 0x4000 | 0x40000, None), "make / private")
    for path in expose:
        parts = path.rstrip("/").split("/")
        closed = [a for a in ("/".join(parts[:i]) for i in range(2, len(parts)))
                  if not os.stat(a).st_mode & 0o001]
        if closed:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
            check(libc.mount(b"tmpfs", closed[0].encode(), b"tmpfs", 2 | 4, b"size=1m,mode=755"),
                  f"tmpfs on {closed[0]}")
            os.makedirs(path, mode=0o755, exist_ok=True)
            check(libc.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, 4096 | 0x4000,
                             None), f"bind {path}")
            os.close(fd)
    keep = {"nosuid": 2, "nodev": 4, "noexec": 8, "noatime": 1024, "nodiratime": 2048,
            "relatime": 1 << 21}
    with open("/proc/self/mountinfo") as f:
        rows = [line.split() for line in f]
    for row in rows:
        point = row[4].replace("\\040", " ").replace("\\011", "\t").replace("\\134", "\\")
        if point.startswith(("/proc", "/sys", "/dev")):
            continue
        flags = 1 | 32 | 4096  # MS_RDONLY | MS_REMOUNT | MS_BIND, keeping the mount's own flags
        flags |= sum(v for k, v in keep.items() if k in row[5].split(","))
        libc.mount(None, point.encode(), None, flags, None)  # best effort per mount
    with open("/proc/self/mountinfo") as f:
        if not any(r.split()[4] == "/" and "ro" in r.split()[5].split(",") for r in f):
            raise OSError(30, "could not make / read-only")
    for d, mb in (("/tmp", tmp_mb), ("/var/tmp", tmp_mb), ("/dev/shm", shm_mb)):
        if os.path.isdir(d):
            check(libc.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4,
                             f"size={mb}m,mode=1777".encode()), f"tmpfs on {d}")
    release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
    if release >= (5, 8):  # per-mount proc options; older kernels would change the host's /proc
        check(libc.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, b"hidepid=invisible"),
              "proc with hidepid")  # jobs see only their own uid's processes


def _prctl(option: int, arg: int) -> None:
    ctypes, libc = _libc()
    if libc.prctl(option, arg, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), f"prctl({option}) failed")


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
        _prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG: die with the pool
        if os.getppid() == 1 and not self.pid1:
            os._exit(3)  # the pool died before we set the death signal
        _prctl(36, 1)  # PR_SET_CHILD_SUBREAPER: orphans of a job come back to us
        if cfg.get("private_mounts"):  # tier B as root: before seccomp, which denies mount
            try:
                private_mounts(**cfg["private_mounts"])
                cfg.update(jobdir="/tmp/job", wipe=["/tmp", "/var/tmp", "/dev/shm"],
                           sweep_owned=[], prefix_fd_path=None)
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
        _prctl(4, 0)  # not dumpable: jobs (same uid in tier A) cannot ptrace or read /proc/1/mem
        if cfg.get("seccomp", True):
            try:
                self.notes.append(apply_seccomp(cfg.get("allow_unix_sockets", False)))
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
            self.mtimes = [_mtime(d) for d in self.owned_dirs]
            status, code, t_start, t_end, out, err = self.run_job(spec)
            header = RESULT_HEADER.pack(STATUSES.index(status), NO_EXIT if code is None else code,
                                        t_recv, t_start, t_end, len(out), len(err))
            write_frame(1, header + out + err)

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
        try:  # compiling here, where it is warm, is ~100x faster than in the fresh child
            spec["compiled"] = compile(spec["code"], "<job>", "exec", dont_inherit=True)
        except BaseException as e:  # noqa: BLE001 - SyntaxError etc.: the child raises it
            spec["compiled"] = e
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
        import shutil

        try:
            os.rmdir(jobdir)  # the common case: the job left nothing
        except FileNotFoundError:
            pass
        except OSError:
            shutil.rmtree(jobdir, ignore_errors=True)
        for d in self.cfg.get("wipe", ()):  # tier A: the private /tmp and /dev/shm
            for entry in _scandir(d):
                _remove(entry)
        for d, before in zip(self.owned_dirs, self.mtimes, strict=False):
            if _mtime(d) != before:  # tier B: what the slot uid left in /tmp etc.
                for entry in _scandir(d):
                    try:
                        if entry.stat(follow_symlinks=False).st_uid == self.uid:
                            _remove(entry)
                    except OSError:
                        pass

    # -- the job process
    def child(self, spec, jobdir, out_w, err_w):
        code = 1
        try:
            os.setsid()
            if self.uid >= 0:
                os.setgroups([])
                os.setresgid(self.gid, self.gid, self.gid)
                os.setresuid(self.uid, self.uid, self.uid)
                if self.cfg.get("prefix_fd_path"):
                    _prctl(4, 1)  # dumpable again, so /proc/self/fd works for the prefix fd
            elif not self.pid1:  # no namespace and no uid sweep: die with the zygote at least
                _prctl(1, self.signal.SIGKILL)
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
            for src, dst in ((stdin, 0), (out_w, 1), (err_w, 2)):
                os.dup2(src, dst, inheritable=True)
            os.set_blocking(1, True)
            os.set_blocking(2, True)
            keep = self.PREFIX_FD if self.cfg.get("prefix_fd_path") else None
            os.closerange(3, keep or 65536)
            if keep:
                os.closerange(keep + 1, 65536)
            sys.stdin, sys.stdout, sys.stderr = self.stdio
            sys.argv = ["<job>"]
            self.gc.enable()
            struct.pack_into("d", self.started, 0, _now())
            self.started.close()
            compiled = spec.pop("compiled")
            if isinstance(compiled, BaseException):
                raise compiled
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


def _scandir(path: str) -> list:
    try:
        return list(os.scandir(path))
    except OSError:
        return []


def _remove(entry) -> None:
    import shutil

    try:
        if entry.is_dir(follow_symlinks=False):
            shutil.rmtree(entry.path, ignore_errors=True)
        else:
            os.unlink(entry.path)
    except OSError:
        pass


# ----------------------------------------------------------------------------- tier A launcher
def launch(cfg: dict) -> None:
    """Root only: private mount namespace, stage unreadable runtime dirs at world-readable mount
    points (e.g. a Python under a 0700 /root), drop to the slot uid, then exec bwrap."""
    ctypes, libc = _libc()

    def check(rc, what):
        if rc != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"{what}: {os.strerror(err)}")

    check(libc.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    check(libc.mount(None, b"/", None, 0x4000 | 0x40000, None), "make / private")  # MS_REC|PRIVATE
    for src, dst in cfg["stage"]:
        check(libc.mount(src.encode(), dst.encode(), None, 0x1000 | 0x4000, None), f"bind {src}")
    os.setgroups([])
    os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.execve(cfg["argv"][0], cfg["argv"], {})


def _main(argv: list[str]) -> None:
    import json

    mode, cfg = argv[0], json.loads(argv[1])
    if mode == "zygote":
        Zygote(cfg).serve()
    elif mode == "launch":
        launch(cfg)
    else:
        raise SystemExit(f"sandbox: unknown mode {mode!r}; valid: zygote, launch")


if __name__ == "__main__":
    _main(sys.argv[1:])
