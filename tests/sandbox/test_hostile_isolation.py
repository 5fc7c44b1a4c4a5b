"""Hostile programs against the sandbox pool's isolation, in every tier this machine offers:
network, secrets and the host file system, SysV IPC, privileges, concurrent jobs. See
hostile_helpers.py for the fixture and the checks after each job.
"""

# ruff: noqa: F811 - `pool` is the fixture imported from hostile_helpers, taken as an argument

from __future__ import annotations

import os
import re
import secrets
import shutil
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest
from hostile_helpers import (  # noqa: F401 - pool: the fixture
    SECRET,
    SECRET_ENV,
    SandboxJob,
    _host_paths_absent,
    _normal_job_ok,
    _pool_processes,
    _private_tmp,
    _zygote_processes,
    pool,
    run_hostile,
)

# --- network ------------------------------------------------------------------------------------


class _Listener:
    """A loopback TCP + UDP listener (and a UNIX socket) that records any contact."""

    def __init__(self, tmp_path):
        self.tcp = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self.tcp.bind(("127.0.0.1", 0))
        self.tcp.listen(8)
        self.tcp.settimeout(0.1)
        self.udp = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
        self.udp.bind(("127.0.0.1", 0))
        self.udp.settimeout(0.1)
        self.unix_path = f"/tmp/jaxrl-hostile-{secrets.token_hex(4)}.sock"
        self.unix = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.unix.bind(self.unix_path)
        os.chmod(self.unix_path, 0o777)
        self.unix.listen(8)
        self.unix.settimeout(0.1)
        self.abstract_name = f"jaxrl-hostile-{secrets.token_hex(4)}"
        self.abstract = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.abstract.bind("\0" + self.abstract_name)
        self.abstract.listen(8)
        self.abstract.settimeout(0.1)
        self.contacts: list[str] = []
        self._stop = False
        self._thread = threading.Thread(target=self._loop, daemon=True)
        self._thread.start()

    def _loop(self):
        while not self._stop:
            for name, s in (("tcp", self.tcp), ("unix", self.unix), ("abstract", self.abstract)):
                try:
                    conn, _ = s.accept()
                    self.contacts.append(name)
                    conn.close()
                except (TimeoutError, OSError):
                    pass
            try:
                self.udp.recvfrom(4096)
                self.contacts.append("udp")
            except (TimeoutError, OSError):
                pass

    def close(self):
        self._stop = True
        self._thread.join(5)
        for s in (self.tcp, self.udp, self.unix, self.abstract):
            s.close()
        os.unlink(self.unix_path)


def test_network_is_unreachable(pool, tmp_path):
    lis = _Listener(tmp_path)
    try:
        tcp_port, udp_port = lis.tcp.getsockname()[1], lis.udp.getsockname()[1]
        res = run_hostile(
            pool,
            f"""
            import socket
            def attempt(name, fn):
                try:
                    fn()
                    print(name, "REACHED")
                except OSError as e:
                    print(name, "blocked", e.errno)
            def tcp():
                s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
                s.settimeout(1)
                s.connect(("127.0.0.1", {tcp_port}))
                s.sendall(b"hello")
            def dns():  # a DNS query for example.com to a loopback "resolver" the test listens on
                q = bytes.fromhex("123401000001000000000000076578616d706c6503636f6d0000010001")
                s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
                s.sendto(q, ("127.0.0.1", {udp_port}))
            def unix():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(1)
                s.connect({lis.unix_path!r})
            def abstract():
                s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
                s.settimeout(1)
                s.connect("\\0" + {lis.abstract_name!r})
            def inet6():
                s = socket.socket(socket.AF_INET6, socket.SOCK_STREAM)
                s.settimeout(1)
                s.connect(("::1", {tcp_port}))
            for name, fn in [("tcp", tcp), ("dns", dns), ("unix", unix), ("abstract", abstract),
                             ("inet6", inet6)]:
                attempt(name, fn)
        """,
            timeout_s=10.0,
        )
        time.sleep(0.3)
        assert lis.contacts == [], f"the sandbox reached the host: {lis.contacts}\n{res.stdout}"
        assert "REACHED" not in res.stdout, res.stdout
        assert res.stdout.count("blocked") == 5, res
    finally:
        lis.close()


# --- secrets and the host file system -------------------------------------------------------------


def test_secrets_stay_out(pool, tmp_path):
    root_only = f"/tmp/jaxrl-hostile-rootonly-{secrets.token_hex(4)}"
    with open(os.open(root_only, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600), "w") as f:
        f.write(SECRET)
    private = tmp_path / "outside.txt"  # under pytest's 0700 tmp dir, outside any job dir
    private.write_text(SECRET)
    os.environ[SECRET_ENV] = SECRET  # also in the pool's environment now
    # A host process with the secret in its command line (e.g. a token passed as an argument).
    holder = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)", SECRET])
    try:
        res = run_hostile(
            pool,
            f"""
            import glob, os
            found = []
            print("env", {SECRET_ENV!r} in os.environ)
            for path in glob.glob("/proc/*/environ") + glob.glob("/proc/*/cmdline") + [
                    {root_only!r}, {str(private)!r}, "/proc/1/root{root_only}",
                    "/proc/self/root{root_only}", "/root/.bash_history", "/etc/shadow"]:
                try:
                    with open(path, "rb") as f:
                        print("READ", path, f.read(100000).hex())
                except OSError as e:
                    print("denied", path, e.errno)
            for k, v in os.environ.items():
                print("ENV", k, v.encode().hex())
        """,
            timeout_s=10.0,
        )
    finally:
        holder.kill()
        holder.wait()
        del os.environ[SECRET_ENV]
        os.unlink(root_only)
    assert "env False" in res.stdout, res
    secret_hex = SECRET.encode().hex()
    leaks = [ln.split()[1] for ln in res.stdout.splitlines() if secret_hex in ln]
    if leaks and pool.tier == "B" and all(re.fullmatch(r"/proc/\d+/cmdline", p) for p in leaks):
        pytest.xfail(
            "pool bug (tier B): the host /proc is mounted in the job (no pid namespace, no "
            f"hidepid), so a job reads other host processes' command lines: {leaks}"
        )
    assert not leaks, f"a secret reached the sandbox via {leaks}"
    for path in (root_only, str(private), "/etc/shadow"):
        assert f"READ {path} " not in res.stdout


def test_writes_outside_the_job_dir(pool, tmp_path):
    tag = secrets.token_hex(4)
    targets = [
        f"/tmp/jaxrl-hostile-w-{tag}",
        f"/dev/shm/jaxrl-hostile-w-{tag}",
        str(tmp_path / f"w-{tag}"),
        os.path.join(os.getcwd(), f"jaxrl-hostile-w-{tag}"),
        f"/var/tmp/jaxrl-hostile-w-{tag}",
        f"/root/jaxrl-hostile-w-{tag}",
    ]
    res = run_hostile(
        pool,
        f"""
        for path in {targets!r}:
            try:
                with open(path, "w") as f:
                    f.write("pwned")
                print("WROTE", path)
            except OSError as e:
                print("denied", path, e.errno)
    """,
    )
    assert res.status == "ok", res
    _host_paths_absent(*targets)


def test_host_files_are_invisible(pool):
    """Tier A sees only the runtime; tier B (root) sees the host read-only but has its own /tmp."""
    if pool.tier == "B" and not _private_tmp(pool):
        pytest.skip("tier B without private mounts (not root): host files stay readable")
    path = f"/tmp/jaxrl-hostile-public-{secrets.token_hex(4)}"
    with open(path, "w") as f:
        f.write(SECRET)
    os.chmod(path, 0o644)
    repo = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    try:
        res = run_hostile(
            pool,
            f"""
            import os
            for p in ({path!r}, {repo!r}, {__file__!r}, "/etc/passwd", "/home", "/var/log"):
                print(p, os.path.exists(p))
            print("root:", sorted(os.listdir("/")))
        """,
        )
    finally:
        os.unlink(path)
    hidden = (
        (path, repo, __file__, "/etc/passwd", "/home", "/var/log") if pool.tier == "A" else (path,)
    )
    for p in hidden:
        assert f"{p} False" in res.stdout, res.stdout


def test_files_in_world_writable_subdirs_do_not_persist(pool):
    # e.g. Ray creates 0777 dirs under /tmp/ray/session_*/; the sweep must reach into them too.
    shared = f"/tmp/jaxrl-hostile-ww-{secrets.token_hex(4)}"
    os.mkdir(shared)
    os.chmod(shared, 0o777)
    try:
        res = run_hostile(
            pool,
            f"""
            try:
                with open("{shared}/planted.py", "w") as f:
                    f.write("import os  # planted by a sandboxed job")
                print("planted")
            except OSError as e:
                print("denied", e.errno)
            """,
        )
        persisted = os.path.exists(f"{shared}/planted.py")
    finally:
        shutil.rmtree(shared)
    if persisted and not _private_tmp(pool):
        pytest.xfail(
            "tier B without private mounts (not root): a job's file in a world-writable "
            "subdirectory of /tmp outlives the job; the sweep only removes top-level entries "
            f"owned by the slot uid ({res.stdout.strip()})"
        )
    assert not persisted


def _sysv_ipc_of(uids: set[int]) -> list[str]:
    rows = []
    for kind in ("shm", "msg", "sem"):
        with open(f"/proc/sysvipc/{kind}") as f:
            lines = f.read().splitlines()
        head = lines[0].split()
        for line in lines[1:]:
            row = dict(zip(head, line.split(), strict=False))
            if int(row["uid"]) in uids:
                rows.append(f"{kind} id={row.get('shmid', row.get('msqid', row.get('semid')))}")
    return rows


IPC_JOB = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    shmid = libc.shmget(0, 32 << 20, 0o1000 | 0o600)  # IPC_PRIVATE | IPC_CREAT, 32 MiB
    if shmid >= 0:
        addr = libc.shmat(shmid, None, 0)
        if addr and addr != ctypes.c_void_p(-1).value:
            ctypes.memset(addr, 7, 32 << 20)
            ctypes.memmove(addr, b"JOB-ONE-DATA", 12)
            libc.shmdt(ctypes.c_void_p(addr))
    msqid = libc.msgget(0, 0o1000 | 0o600)
    semid = libc.semget(0, 1, 0o1000 | 0o600)
    print("created", shmid, msqid, semid)
"""

IPC_PROBE = """
    import ctypes
    libc = ctypes.CDLL(None, use_errno=True)
    libc.shmat.restype = ctypes.c_void_p
    for kind in ("shm", "msg", "sem"):
        lines = open("/proc/sysvipc/" + kind).read().splitlines()[1:]
        print(kind, "objects", len(lines))
    for shmid in range(4):
        addr = libc.shmat(shmid, None, 0o10000)  # SHM_RDONLY
        if addr and addr != ctypes.c_void_p(-1).value:
            print("read", ctypes.string_at(addr, 12))
"""


def test_ipc_objects_do_not_outlive_the_job(pool):
    uids = set(pool.slot_uids)
    before = set(_sysv_ipc_of(uids))
    leaked_host: list[str] = []
    try:
        res = run_hostile(pool, IPC_JOB, memory_mb=256)
        assert res.status == "ok", res
        leaked_host = sorted(set(_sysv_ipc_of(uids)) - before)
        probes = pool.run([SandboxJob(code=textwrap.dedent(IPC_PROBE))] * pool.num_workers)
        seen = [r.stdout for r in probes]
    finally:
        for row in _sysv_ipc_of(uids):  # leave the host clean whatever happened
            kind, ident = row.split(" id=")
            flag = {"shm": "-m", "msg": "-q", "sem": "-s"}[kind]
            subprocess.run(["ipcrm", flag, ident], capture_output=True)
    leaked_ns = [out for out in seen if "JOB-ONE-DATA" in out or re.search(r"objects [1-9]", out)]
    problems = []
    if leaked_host:
        problems.append(f"SysV IPC objects outlived the job on the host: {leaked_host}")
    if leaked_ns:
        problems.append(f"a later job saw an earlier job's SysV IPC objects: {leaked_ns}")
    assert not problems, f"tier {pool.tier}: " + "; ".join(problems)


# --- privileges ---------------------------------------------------------------------------------


def test_privileges(pool):
    res = run_hostile(
        pool,
        """
        import ctypes, os
        libc = ctypes.CDLL(None, use_errno=True)
        status = open("/proc/self/status").read()
        for key in ("NoNewPrivs", "CapEff", "CapPrm", "CapAmb", "Seccomp"):
            print(key, [l.split()[1] for l in status.splitlines() if l.startswith(key + ":")][0])
        def denied(name, rc):
            print(name, "DENIED" if rc != 0 else "ALLOWED", ctypes.get_errno())
        denied("ptrace_traceme", libc.ptrace(0, 0, 0, 0))
        denied("ptrace_attach_parent", libc.ptrace(16, os.getppid(), 0, 0))
        denied("unshare_user", libc.unshare(0x10000000))
        denied("unshare_net", libc.unshare(0x40000000))
        denied("mount_tmpfs", libc.mount(b"none", b"/tmp", b"tmpfs", 0, None))
        denied("setuid0", libc.setuid(0))
        denied("chroot", libc.chroot(b"/"))
        import platform
        nr_clone = {"x86_64": 56, "aarch64": 220}.get(platform.machine())
        if nr_clone:  # raw clone(CLONE_NEWUSER | SIGCHLD): a namespace without unshare()
            rc = libc.syscall(nr_clone, 0x10000000 | 17, 0, 0, 0, 0)
            if rc == 0:
                os._exit(0)  # the child, had it been allowed
            denied("clone_newuser", rc)
        else:
            print("clone_newuser DENIED n/a")
        rc = libc.syscall(435, None, 0)  # clone3: arguments in memory, so refused outright
        print("clone3", "DENIED" if rc != 0 else "ALLOWED", ctypes.get_errno())
        print("uid", os.getuid(), os.geteuid())
    """,
    )
    out = dict(line.split(None, 1) for line in res.stdout.splitlines())
    assert out["NoNewPrivs"] == "1", res.stdout
    assert int(out["CapEff"], 16) == 0 and int(out["CapPrm"], 16) == 0, res.stdout
    for name in (
        "ptrace_traceme",
        "ptrace_attach_parent",
        "unshare_user",
        "unshare_net",
        "mount_tmpfs",
        "setuid0",
        "chroot",
        "clone_newuser",
        "clone3",
    ):
        assert out[name].startswith("DENIED"), (name, res.stdout)
    assert out["Seccomp"] == "2", res.stdout


# --- isolation between concurrent jobs -----------------------------------------------------------


def test_concurrent_jobs_same_tmp_path_and_port(pool):
    code = """
        import os, socket, tempfile, time
        me = {me!r}
        paths = (os.path.join(tempfile.gettempdir(), "shared.txt"), "shared.txt",
                 "/tmp/jaxrl-shared.txt")
        for path in paths:
            try:
                with open(path, "w") as f:
                    f.write(me)
            except OSError as e:
                print("write", path, "denied", e.errno)
        try:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 47811))
            print("bind ok")
        except OSError as e:
            print("bind", e.errno)
        time.sleep(1.0)
        for path in paths:
            try:
                print("read", path, open(path).read())
            except OSError as e:
                print("read", path, "error", e.errno)
    """
    jobs = [
        SandboxJob(code=textwrap.dedent(code.format(me=m)), timeout_s=10) for m in ("AAA", "BBB")
    ]
    t0 = time.monotonic()
    ra, rb = pool.run(jobs)
    assert time.monotonic() - t0 < 1.9, "the two jobs did not run concurrently"
    print(f"[tier {pool.tier}]", ra.stdout, rb.stdout)
    shared_tmp_leak = []
    for res, me, other in ((ra, "AAA", "BBB"), (rb, "BBB", "AAA")):
        assert res.status == "ok", res
        assert f"read shared.txt {me}" in res.stdout, res.stdout  # job dir (cwd) is private
        lines = res.stdout.splitlines()
        tmpdir_line = [
            ln
            for ln in lines
            if ln.startswith("read ") and "/shared.txt" in ln and "jaxrl-shared" not in ln
        ]
        assert tmpdir_line == [tmpdir_line[0]] and tmpdir_line[0].endswith(me), res.stdout
        assert "bind ok" not in res.stdout, res.stdout  # inet sockets are denied in both tiers
        if other in res.stdout:
            shared_tmp_leak.append(f"job {me} read job {other}'s /tmp/jaxrl-shared.txt")
    _host_paths_absent("/tmp/jaxrl-shared.txt")
    _normal_job_ok(pool)
    if shared_tmp_leak and not _private_tmp(pool):
        pytest.xfail(f"tier B without private mounts shares /tmp between jobs: {shared_tmp_leak}")
    assert not shared_tmp_leak, shared_tmp_leak
