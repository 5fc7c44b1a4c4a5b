"""The zygote's calls into the kernel: the seccomp filter, private mounts, the tier-A launcher and
a tree removal that cannot be stopped by what a job left.

Stdlib-only, like `zygote.py`: the zygote program loads this file's source as the top-level
module `syscalls` before `zygote.py` (see `zygote.zygote_program`), so nothing here may import
jaxrl, jax or numpy.
"""

import fcntl
import os
import struct

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
        semtimedop=220, mq_open=240, pidfd_getfd=438, process_madvise=440, kcmp=312,
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
        semop=193, shmget=194, shmctl=195, shmat=196, shmdt=197, mq_open=180, pidfd_getfd=438,
        process_madvise=440, kcmp=272,
    ),
}
# Every call that creates a socket or gives one an address (x86_64 has no socketcall).
_SOCKET_NRS = {
    "x86_64": dict(socket=41, connect=42, accept=43, sendto=44, sendmsg=46, bind=49, listen=50,
                   socketpair=53, accept4=288, sendmmsg=307),
    "aarch64": dict(socket=198, socketpair=199, bind=200, listen=201, accept=202, connect=203,
                    sendto=206, sendmsg=211, accept4=242, sendmmsg=269),
}
_CLONE_NR = {"x86_64": 56, "aarch64": 220}
_CLONE3_NR = 435
# CLONE_NEWNS | NEWCGROUP | NEWUTS | NEWIPC | NEWUSER | NEWPID | NEWNET | NEWTIME
_CLONE_NS_FLAGS = 0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 | 0x10000000 | 0x20000000
_CLONE_NS_FLAGS |= 0x40000000 | 0x00000080
_ARG = [16 + 8 * i for i in range(6)]  # offset of syscall argument i (low 32 bits; high at +4)
_AF_UNIX = 1


def seccomp_program(arch: str, allow_unix_sockets: bool) -> bytes:
    """The BPF filter (struct sock_filter[]) for `arch`; raises ValueError for an unknown arch.

    Sockets: with `allow_unix_sockets` (tier A: the job has its own network namespace),
    `socket`/`socketpair` are allowed for AF_UNIX only. Without it (tier B: the host's network
    namespace), no socket can be created or addressed: `socket`, `bind`, `connect`, `listen`,
    `accept*`, `sendmsg`, `sendmmsg` are denied, `sendto` only with a NULL address, and only an
    AF_UNIX `socketpair` is allowed (asyncio's self-pipe), which can talk to its own peer only.
    """
    if arch not in _AUDIT_ARCH:
        raise ValueError(f"no seccomp filter for arch {arch!r}; known: {sorted(_AUDIT_ARCH)}")
    ld, jeq, jge, jset, ret = 0x20, 0x15, 0x35, 0x45, 0x06
    nrs = _SOCKET_NRS[arch]
    ins: list[tuple] = [(ld, 0, 0, 4), (jeq, 0, "kill", _AUDIT_ARCH[arch]), (ld, 0, 0, 0)]
    if arch == "x86_64":
        ins.append((jge, "deny", 0, 0x40000000))  # the x32 ABI
    denied = set(_DENY_NRS[arch].values())
    if not allow_unix_sockets:
        denied |= {nrs[n] for n in ("socket", "bind", "connect", "listen", "accept", "accept4",
                                    "sendmsg", "sendmmsg")}
    ins += [(jeq, "deny", 0, nr) for nr in sorted(denied)]
    ins += [(jeq, "unix_only", 0, nrs["socketpair"])]
    if allow_unix_sockets:
        ins.append((jeq, "unix_only", 0, nrs["socket"]))
    else:
        ins.append((jeq, "no_address", 0, nrs["sendto"]))
    ins += [
        (jeq, "clone", 0, _CLONE_NR[arch]),
        (jeq, "enosys", 0, _CLONE3_NR),  # clone3 args live in memory: make libc fall back to clone
        (ret, 0, 0, 0x7FFF0000),
    ]
    labels = {"unix_only": len(ins)}
    ins += [(ld, 0, 0, _ARG[0]), (jeq, "allow", "deny", _AF_UNIX)]
    labels["no_address"] = len(ins)  # sendto(fd, buf, len, flags, dest_addr, addrlen)
    ins += [(ld, 0, 0, _ARG[4]), (jeq, 0, "deny", 0), (ld, 0, 0, _ARG[4] + 4),
            (jeq, "allow", "deny", 0)]
    labels["clone"] = len(ins)
    ins += [(ld, 0, 0, _ARG[0]), (jset, "deny", "allow", _CLONE_NS_FLAGS)]
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


def libc():
    """(ctypes, the C library), loaded once."""
    if not _LIBC:
        import ctypes

        _LIBC.extend((ctypes, ctypes.CDLL(None, use_errno=True)))
    return _LIBC[0], _LIBC[1]


def _check(rc: int, what: str) -> None:
    if rc != 0:
        ctypes, _ = libc()
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def dup_above(fd: int, lowest: int) -> int:
    """A duplicate of `fd` numbered `lowest` or more (fcntl F_DUPFD), not inherited."""
    new = fcntl.fcntl(fd, fcntl.F_DUPFD, lowest)
    os.set_inheritable(new, False)
    return new


def prctl(option: int, arg: int) -> None:
    _, lib = libc()
    _check(lib.prctl(option, arg, 0, 0, 0), f"prctl({option})")


def apply_seccomp(allow_unix_sockets: bool) -> str:
    """Sets no_new_privs and installs the filter on this process (inherited by its children)."""
    import platform

    ctypes, lib = libc()
    prog = seccomp_program(platform.machine(), allow_unix_sockets)
    _check(lib.prctl(38, 1, 0, 0, 0), "prctl(PR_SET_NO_NEW_PRIVS)")
    buf = ctypes.create_string_buffer(prog)

    class Fprog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    fprog = Fprog(len(prog) // 8, ctypes.addressof(buf))
    # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
    _check(lib.prctl(22, 2, ctypes.byref(fprog), 0, 0), "prctl(PR_SET_SECCOMP)")
    return f"seccomp({len(prog) // 8} insns)"


# ----------------------------------------------------------------------------- mounts
def private_mounts(tmp_mb: int, shm_mb: int, expose: tuple = ()) -> None:
    """Root without user namespaces: a private mount namespace where every host filesystem is
    read-only and /tmp, /var/tmp, /dev/shm are fresh size-capped tmpfs (so a job can neither
    leave files on the host nor see another slot's), and /proc shows a job only its own
    processes (hidepid). Each `expose` path (the interpreter's
    prefix) is made reachable by covering its first untraversable ancestor (e.g. a 0700 /root)
    with an empty tmpfs and binding the path back: the rest of that ancestor stays hidden."""
    _, lib = libc()
    _check(lib.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    _check(lib.mount(None, b"/", None, 0x4000 | 0x40000, None), "make / private")
    for path in expose:
        parts = path.rstrip("/").split("/")
        closed = [a for a in ("/".join(parts[:i]) for i in range(2, len(parts)))
                  if not os.stat(a).st_mode & 0o001]
        if closed:
            fd = os.open(path, os.O_PATH | os.O_DIRECTORY)
            _check(lib.mount(b"tmpfs", closed[0].encode(), b"tmpfs", 2 | 4, b"size=1m,mode=755"),
                   f"tmpfs on {closed[0]}")
            os.makedirs(path, mode=0o755, exist_ok=True)
            _check(lib.mount(f"/proc/self/fd/{fd}".encode(), path.encode(), None, 4096 | 0x4000,
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
        lib.mount(None, point.encode(), None, flags, None)  # best effort per mount
    with open("/proc/self/mountinfo") as f:
        if not any(r.split()[4] == "/" and "ro" in r.split()[5].split(",") for r in f):
            raise OSError(30, "could not make / read-only")
    for d, mb in (("/tmp", tmp_mb), ("/var/tmp", tmp_mb), ("/dev/shm", shm_mb)):
        if os.path.isdir(d):
            _check(lib.mount(b"tmpfs", d.encode(), b"tmpfs", 2 | 4,
                             f"size={mb}m,mode=1777".encode()), f"tmpfs on {d}")
    release = tuple(int(x) for x in os.uname().release.split(".")[:2] if x.isdigit())
    if release >= (5, 8):  # per-mount proc options; older kernels would change the host's /proc
        _check(lib.mount(b"proc", b"/proc", b"proc", 2 | 4 | 8, b"hidepid=invisible"),
               "proc with hidepid")  # jobs see only their own uid's processes


def launch(cfg: dict) -> None:
    """Tier A, root only: private mount namespace, stage unreadable runtime dirs at world-readable
    mount points (e.g. a Python under a 0700 /root), drop to the slot uid, then exec bwrap."""
    _, lib = libc()
    _check(lib.unshare(0x00020000), "unshare(CLONE_NEWNS)")
    _check(lib.mount(None, b"/", None, 0x4000 | 0x40000, None), "make / private")  # REC|PRIVATE
    for src, dst in cfg["stage"]:
        _check(lib.mount(src.encode(), dst.encode(), None, 0x1000 | 0x4000, None), f"bind {src}")
    os.setgroups([])
    os.setresgid(cfg["gid"], cfg["gid"], cfg["gid"])
    os.setresuid(cfg["uid"], cfg["uid"], cfg["uid"])
    os.execve(cfg["argv"][0], cfg["argv"], {})


# ----------------------------------------------------------------------------- tree removal
_DIR = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC


def _enter(parent_fd: int, name: str) -> int:
    """Opens directory `name` (never through a link), making it ours to list and empty first:
    a job may have taken its read, write or search bit away."""
    pfd = os.open(name, os.O_PATH | os.O_NOFOLLOW | os.O_DIRECTORY | os.O_CLOEXEC,
                  dir_fd=parent_fd)
    try:
        if os.fstat(pfd).st_mode & 0o700 != 0o700:
            try:
                os.chmod(f"/proc/self/fd/{pfd}", 0o700)  # the inode we opened, not a path
            except OSError:
                os.chmod(name, 0o700, dir_fd=parent_fd)  # no /proc: the job is gone, no race
        return os.open(".", _DIR, dir_fd=pfd)
    finally:
        os.close(pfd)


def remove_entry(parent_fd: int, name: str) -> None:
    """Removes `name` in directory `parent_fd`, whatever it is (a file, a link, a whole tree),
    without following links and without recursion: one directory fd is open at a time and the
    way back up is `..`, so depth (even beyond PATH_MAX) and locked directories cost nothing but
    time. Raises OSError if something cannot be removed."""
    try:
        os.unlink(name, dir_fd=parent_fd)
        return
    except FileNotFoundError:
        return
    except IsADirectoryError:  # Linux's unlink(2) on a directory
        pass
    cur = os.open(".", _DIR, dir_fd=parent_fd)
    stack: list[tuple[str, list[str]]] = []  # (a directory's name in its parent, its subdirs)
    enter: str | None = name
    try:
        while True:
            if enter is not None:
                child = _enter(cur, enter)
                os.close(cur)
                cur, subdirs = child, []
                with os.scandir(cur) as it:
                    for e in it:
                        if e.is_dir(follow_symlinks=False):
                            subdirs.append(e.name)
                        else:
                            try:
                                os.unlink(e.name, dir_fd=cur)
                            except FileNotFoundError:
                                pass
                stack.append((enter, subdirs))
            here, pending = stack[-1]
            if pending:
                enter = pending.pop()
                continue
            enter = None
            up = os.open("..", _DIR, dir_fd=cur)
            os.close(cur)
            cur = up
            stack.pop()
            os.rmdir(here, dir_fd=cur)
            if not stack:
                return
    finally:
        os.close(cur)


def empty_dir(path: str, keep: frozenset = frozenset()) -> list[str]:
    """Removes every entry of directory `path` but those named in `keep`; returns what is left
    that should not be (empty when the wipe worked). Streams the listing: a directory of a
    million files costs no more memory than one of ten."""
    try:
        fd = os.open(path, _DIR)
    except FileNotFoundError:
        return []
    try:
        for _ in range(3):  # removing while listing may skip entries: list again until clean
            found = False
            with os.scandir(fd) as it:
                for e in it:
                    if e.name not in keep:
                        found = True
                        try:
                            remove_entry(fd, e.name)
                        except OSError:
                            pass
            if not found:
                return []
        return [f"{path}/{n}" for n in os.listdir(fd) if n not in keep]
    finally:
        os.close(fd)
