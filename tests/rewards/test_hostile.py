"""Hostile programs against the sandbox pool, in every tier this machine offers.

Each hostile program bounds itself (a deadline, a budget) so that it stops on its own even if the
sandbox failed to stop it; the pool's limits are set well below those bounds. After each one the
test asserts that nothing reached the host, that no process outlived the job, that a normal job on
the same pool still succeeds, and that the pool kept its size. Tests are parametrised over tiers A
(bubblewrap + namespaces) and B (uid + rlimits + seccomp); the tier is in each test id. Only
loopback addresses are ever targeted.
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import shutil
import socket
import stat
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxrl.rewards import LocalSandboxPool, SandboxJob
from jaxrl.rewards.rewards import get_reward

SECRET = "jaxrl-secret-" + secrets.token_hex(8)
SECRET_ENV = "JAXRL_HOSTILE_TEST_SECRET"


# --- fixtures and helpers ------------------------------------------------------------------------


def _user_namespaces_work() -> bool | None:
    """Whether this machine lets a process create a user namespace (None: cannot tell)."""
    if shutil.which("unshare") is None:
        return None
    return subprocess.run(["unshare", "--user", "true"], capture_output=True).returncode == 0


@pytest.fixture(scope="module", params=["A", "B"])
def pool(request):
    tier = request.param
    os.environ[SECRET_ENV] = SECRET  # the launcher's environment holds a secret
    try:
        p = LocalSandboxPool(num_workers=2, tier=tier)
    except RuntimeError as e:
        if tier == "A" and _user_namespaces_work() is not True:
            pytest.skip(f"tier A unavailable (no user namespaces on this machine): {e}")
        raise  # tier B must always start; tier A must start wherever user namespaces work
    finally:
        del os.environ[SECRET_ENV]
    with p:
        assert p.tier == tier, f"asked for tier {tier}, pool runs tier {p.tier}"
        print(f"\nsandbox tier {p.tier}: {p.tier_detail}")
        yield p


_PRIVATE_TMP: dict[str, bool] = {}


def _private_tmp(pool) -> bool:
    """Whether jobs get their own /tmp (tier A; tier B run as root), probed once per tier: a job
    writes a file in /tmp and the host looks for it while the job still runs."""
    if pool.tier not in _PRIVATE_TMP:
        name = f"/tmp/jaxrl-hostile-probe-{secrets.token_hex(4)}"
        code = f"import time\nopen({name!r}, 'w').close()\ntime.sleep(1.0)"
        fut = pool.submit([SandboxJob(code=code, timeout_s=5)])
        seen, deadline = False, time.monotonic() + 0.9
        while not seen and time.monotonic() < deadline:
            seen = os.path.exists(name)
            time.sleep(0.02)
        fut.result()
        _PRIVATE_TMP[pool.tier] = not seen
    return _PRIVATE_TMP[pool.tier]


def _proc_table() -> dict[int, tuple[int, int, str]]:
    """pid -> (real uid, ppid, comm) of every process on the host."""
    rows = {}
    for d in os.listdir("/proc"):
        if not d.isdigit():
            continue
        try:
            with open(f"/proc/{d}/status") as f:
                st = f.read()
        except OSError:
            continue
        uid = re.search(r"^Uid:\s+(\d+)", st, re.M)
        ppid = re.search(r"^PPid:\s+(\d+)", st, re.M)
        name = re.search(r"^Name:\s+(.*)$", st, re.M)
        state = re.search(r"^State:\s+(\S)", st, re.M)
        if uid and ppid and not (state and state.group(1) == "Z"):
            rows[int(d)] = (int(uid.group(1)), int(ppid.group(1)), name.group(1) if name else "")
    return rows


def _pool_processes(pool) -> set[int]:
    """Processes that belong to the pool: descendants of this process, plus any process of a
    slot uid wherever it was reparented to."""
    table = _proc_table()
    children = collections.defaultdict(list)
    for pid, (_, ppid, _) in table.items():
        children[ppid].append(pid)
    out, stack = set(), [os.getpid()]
    while stack:
        for c in children[stack.pop()]:
            out.add(c)
            stack.append(c)
    uids = set(pool.slot_uids)
    out |= {pid for pid, (uid, _, _) in table.items() if uid in uids}
    return out


def _zygote_processes(pool) -> set[int]:
    """The pool's own long-lived processes: each slot's zygote (tier A: bwrap and, as its child,
    the zygote as PID 1 of the namespace). Private attributes: read-only use in tests."""
    pids = {s.zygote.proc.pid for s in pool._slots if s.zygote is not None}
    if pool.tier == "A":
        pids |= {pid for pid, (_, ppid, _) in _proc_table().items() if ppid in pids}
    return pids


def _pool_size_kept(pool, size: int) -> None:
    assert pool.num_workers == size
    alive = [s for s in pool._slots if s.zygote is not None and s.zygote.alive()]
    assert len(alive) == size, f"{size - len(alive)} of {size} sandbox workers are gone"


def _normal_job_ok(pool) -> None:
    (r,) = pool.run(
        [SandboxJob(code="import os\nprint(6 * 7, sorted(os.listdir('.')))", timeout_s=10)]
    )
    assert r.status == "ok" and r.stdout.split() == ["42", "[]"], r


def run_hostile(
    pool,
    code: str,
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    max_wall_s=20.0,
    stdin: str = "",
):
    """Runs one hostile job; checks bounded return, no survivors, pool health and size."""
    size = pool.num_workers
    before = _pool_processes(pool)
    t0 = time.monotonic()
    (res,) = pool.run(
        [
            SandboxJob(
                code=textwrap.dedent(code), stdin=stdin, timeout_s=timeout_s, memory_mb=memory_mb
            )
        ]
    )
    wall = time.monotonic() - t0
    print(
        f"[tier {pool.tier}] {res.status} exit={res.exit_code} {wall:.2f}s "
        f"out={res.stdout[-300:]!r} err={res.stderr[-300:]!r}"
    )
    assert wall < max_wall_s, f"job took {wall:.1f} s (limit {timeout_s} s): {res}"
    deadline = time.monotonic() + 5.0
    while True:
        leftover = _pool_processes(pool) - before - _zygote_processes(pool)
        if not leftover or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    table = _proc_table()
    assert not leftover, f"processes outlived the job: {[(p, table.get(p)) for p in leftover]}"
    _normal_job_ok(pool)
    _pool_size_kept(pool, size)
    return res


def _host_paths_absent(*paths: str) -> None:
    for p in paths:
        assert not os.path.lexists(p), f"sandboxed job left {p} on the host"


def test_leftover_detector_sees_a_running_job(pool):
    """Self-check of this suite: while a job runs, its processes are found as the pool's."""
    before = _pool_processes(pool)
    fut = pool.submit([SandboxJob(code="import os, time\nos.fork()\ntime.sleep(1.5)", timeout_s=5)])
    seen: set[int] = set()
    deadline = time.monotonic() + 1.2
    while len(seen) < 2 and time.monotonic() < deadline:
        seen = _pool_processes(pool) - before - _zygote_processes(pool)
        time.sleep(0.05)
    (res,) = fut.result()
    assert len(seen) >= 2, f"the detector missed the job's processes ({res})"
    time.sleep(0.2)
    assert not (_pool_processes(pool) - before - _zygote_processes(pool))


# --- resource exhaustion ------------------------------------------------------------------------


def test_infinite_cpu_loop(pool):
    res = run_hostile(
        pool,
        """
        import time
        end = time.monotonic() + 30
        while time.monotonic() < end:
            pass
    """,
        timeout_s=1.0,
        max_wall_s=6,
    )
    assert res.status == "timeout"


def test_sleep_forever(pool):
    res = run_hostile(pool, "import time\ntime.sleep(30)\n", timeout_s=1.0, max_wall_s=6)
    assert res.status == "timeout"


def test_memory_bomb(pool):
    res = run_hostile(
        pool,
        """
        chunks = []
        for _ in range(64):  # at most 4 GiB, far above the 128 MiB limit
            chunks.append(bytearray(64 << 20))
        print("allocated", len(chunks))
    """,
        memory_mb=128,
        timeout_s=5.0,
    )
    assert res.status in ("oom", "killed"), res
    assert "allocated" not in res.stdout


@pytest.mark.parametrize("where", ["/tmp", "/dev/shm", "."])
def test_memory_bomb_via_files(pool, where):
    name = f"jaxrl-hostile-{secrets.token_hex(4)}"
    res = run_hostile(
        pool,
        f"""
        import os, time
        end = time.monotonic() + 10
        written = 0
        for i in range(16):  # at most 16 files x 64 MiB = 1 GiB
            try:
                with open(os.path.join({where!r}, "{name}-%d" % i), "wb") as f:
                    for _ in range(64):
                        f.write(b"x" * (1 << 20))
                        written += 1 << 20
            except OSError as e:
                print("stopped:", type(e).__name__)
                break
            print("written_mb", written >> 20, flush=True)
            if time.monotonic() > end:
                break
    """,
        timeout_s=5.0,
    )
    assert res.status in ("ok", "error", "output_limit", "timeout", "oom"), res
    _host_paths_absent(*(os.path.join(where, f"{name}-{i}") for i in range(16) if where != "."))
    written_mb = max([int(n) for n in re.findall(r"written_mb (\d+)", res.stdout)] or [0])
    if written_mb > 256 and not _private_tmp(pool):
        pytest.xfail(
            f"tier B without private mounts (not root): a job wrote {written_mb} MiB into "
            f"{where} on the host within its timeout; only RLIMIT_FSIZE per file bounds it"
        )
    assert written_mb <= 256, f"job wrote {written_mb} MiB to {where}: no size cap"


@pytest.mark.slow
def test_fork_bomb(pool):
    res = run_hostile(
        pool,
        """
        import os, time
        end = time.monotonic() + 15
        budget = 600  # total processes this bomb may ever create
        while budget > 0 and time.monotonic() < end:
            try:
                pid = os.fork()
            except OSError:
                time.sleep(0.01)
                continue
            if pid == 0:  # the child keeps bombing with half of what is left
                budget //= 2
            else:
                budget -= budget // 2 + 1
        while time.monotonic() < end:
            time.sleep(0.2)
    """,
        timeout_s=2.0,
        max_wall_s=15,
    )
    assert res.status in ("timeout", "killed", "error", "ok"), res


def test_thread_bomb(pool):
    res = run_hostile(
        pool,
        """
        import threading, time
        end = time.monotonic() + 15
        n = 0
        try:
            for _ in range(3000):
                threading.Thread(target=time.sleep, args=(max(0, end - time.monotonic()),),
                                 daemon=True).start()
                n += 1
        except (RuntimeError, MemoryError) as e:
            print("stopped at", n, type(e).__name__)
        time.sleep(max(0, end - time.monotonic()))
    """,
        timeout_s=2.0,
    )
    assert res.status in ("timeout", "error", "oom", "killed"), res


def test_disk_fill_one_big_file(pool):
    res = run_hostile(
        pool,
        """
        with open("big.bin", "wb") as f:
            for _ in range(2048):  # at most 2 GiB
                f.write(b"\\0" * (1 << 20))
        print("wrote 2 GiB")
    """,
        timeout_s=10.0,
    )
    assert res.status in ("error", "output_limit"), res
    assert "wrote 2 GiB" not in res.stdout


def test_disk_fill_many_files(pool):
    res = run_hostile(
        pool,
        """
        import os, time
        end = time.monotonic() + 10
        n = 0
        os.makedirs("d", exist_ok=True)
        while n < 200000 and time.monotonic() < end:
            with open("d/%d" % n, "w") as f:
                f.write("x")
            n += 1
        print(n)
    """,
        timeout_s=2.0,
    )
    assert res.status in ("timeout", "ok", "error"), res


def test_output_flood(pool):
    res = run_hostile(
        pool,
        """
        import sys
        line = "y" * 1023 + "\\n"
        for _ in range(256 * 1024):  # at most 256 MiB
            sys.stdout.write(line)
    """,
        timeout_s=10.0,
    )
    assert res.status == "output_limit", res
    assert len(res.stdout.encode()) <= SandboxJob(code="").max_output_bytes


def test_fd_exhaustion(pool):
    res = run_hostile(
        pool,
        """
        import os
        fds = []
        try:
            for _ in range(1 << 20):
                fds.append(os.open("/dev/null", os.O_RDONLY))
        except OSError as e:
            print("stopped at", len(fds), e.errno)
    """,
    )
    assert res.status == "ok" and "stopped at" in res.stdout, res
    assert int(res.stdout.split()[2]) < 100000


@pytest.mark.slow
def test_deep_recursion_segfault(pool):
    res = run_hostile(
        pool,
        """
        import sys
        sys.setrecursionlimit(10 ** 7)
        x = []
        for _ in range(300_000):
            x = [x]
        print(len(repr(x)))  # C-level recursion past the stack: SIGSEGV
    """,
        timeout_s=10.0,
    )
    assert res.status in ("killed", "error", "oom"), res


# --- processes that try to outlive their job or hit the pool ----------------------------------


def test_setsid_daemon_holding_the_pipe(pool):
    res = run_hostile(
        pool,
        """
        import os, time
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # the grandchild keeps stdout/stderr open for 30 s
                end = time.monotonic() + 30
                while time.monotonic() < end:
                    time.sleep(0.1)
                os._exit(0)
            os._exit(0)
        os.wait()
        print("parent done")
    """,
        timeout_s=10.0,
        max_wall_s=5,
    )
    assert res.status == "ok" and "parent done" in res.stdout, res


def test_kill_everything_and_the_parent(pool):
    res = run_hostile(
        pool,
        """
        import os, signal
        for target in (os.getppid(), 1, -1):
            try:
                os.kill(target, signal.SIGKILL)
            except OSError as e:
                print("kill", target, "->", e.errno)
        print("still here")
    """,
    )
    assert res.status in ("ok", "killed"), res  # kill(-1) may take the job itself too


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


# --- reward hacks through code_tests -----------------------------------------------------------

ADD_TESTS = [{"fn": "add", "args": [a, b], "expected": a + b} for a, b in [(1, 2), (3, 4), (5, 9)]]
STDIN_TESTS = [{"input": "1 2\n", "output": "3\n"}, {"input": "4 4\n", "output": "8\n"}]

HACKS = {
    "exit0": "import sys\nsys.exit(0)\n",
    "os_exit0": "import os\nos._exit(0)\n",
    "eq_always_true": """
        class A:
            __eq__ = lambda s, o: True
            __hash__ = None
        def add(a, b):
            return A()
        print(A())
    """,
    "patched_builtins": """
        import builtins
        builtins.repr = lambda v: "3"
        builtins.type = lambda v: int
        builtins.print = lambda *a, **k: None
        def add(a, b):
            return None
    """,
    "fake_pass_markers": """
        import sys
        caller = sys._getframe(0).f_back  # the harness: read its nonce and forge result lines
        nonce = caller.f_globals.get("_NONCE", "x") if caller else "x"
        for i, v in enumerate([3, 7, 14]):
            print(nonce, i, "value", v)
        print("PASS\nPASS\n3\n8")
        def add(a, b):
            return -1
    """,
}


@pytest.mark.parametrize("hack", sorted(HACKS))
def test_reward_hacks_score_zero(pool, hack):
    code_tests = get_reward("code_tests").fn
    before = _pool_processes(pool)
    code = textwrap.dedent(HACKS[hack])
    assert code_tests("p", code, tests=ADD_TESTS, pool=pool) == 0.0, hack
    assert code_tests("p", code, tests=STDIN_TESTS, pool=pool) == 0.0, hack
    assert code_tests("p", code, tests=STDIN_TESTS, pool=pool, mode="all") == 0.0, hack
    assert not (_pool_processes(pool) - before)
    honest = "def add(a, b):\n    return a + b\n"
    assert code_tests("p", honest, tests=ADD_TESTS, pool=pool) == 1.0


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


def test_pool_is_intact_after_the_suite(pool):
    assert pool.num_workers == 2
    results = pool.run([SandboxJob(code=f"print({i})") for i in range(8)])
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(8)]
    assert all(r.status == "ok" for r in results)
    assert stat.S_IMODE(os.stat("/tmp").st_mode) & 0o1000  # the host /tmp kept its sticky bit
