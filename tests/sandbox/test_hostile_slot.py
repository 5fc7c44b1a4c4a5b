"""Hostile jobs against one sandbox slot: what a job leaves, what it costs the zygote, who it can
reach, and whether it outlives its pool. Both tiers (the tier is in each test id).

Each test runs the hostile job on a one-slot pool, so the ordinary job that follows runs in the
same slot (and the same zygote, unless the test expects a restart); it then asserts that ordinary
job succeeds and that `stats()["restarts"]` moved by exactly what the test expects.
"""

from __future__ import annotations

import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from jaxrl.sandbox import LocalSandboxPool, SandboxJob
from jaxrl.sandbox import pool as pool_mod


def _tier_a_reason() -> str | None:
    try:
        pool_mod.probe("A")
        return None
    except RuntimeError as e:
        return str(e)


@pytest.fixture(scope="module", params=["A", "B"])
def slot(request):
    """A one-slot pool of the tier in the test id."""
    if request.param == "A" and (why := _tier_a_reason()):
        pytest.skip(f"tier A (user namespaces via bwrap) unavailable here: {why}")
    with LocalSandboxPool(num_workers=1, tier=request.param) as p:
        assert p.tier == request.param
        yield p


ORDINARY = """
import os
paths = {}
for d in (".", "/tmp", "/dev/shm", "/dev"):
    try:
        paths[d] = sorted(os.listdir(d))
    except OSError as e:
        paths[d] = "error %d" % e.errno
with open("scratch.bin", "wb") as f:  # scratch space works: 4 MiB in the job dir
    f.write(b"x" * (4 << 20))
print(repr(paths))
"""


def _listing(pool) -> dict:
    (r,) = pool.run([SandboxJob(code=ORDINARY, timeout_s=10)])
    assert r.status == "ok", f"the ordinary job after the hostile one failed: {r}"
    return eval(r.stdout)  # noqa: S307 - a dict of lists printed by the job above


def run_then_ordinary(pool, code: str, *, restarts: int = 0, **job):
    """Runs hostile `code`, then the ordinary job in the same slot; returns (hostile result,
    the ordinary job's directory listing). Asserts the restart count moved by `restarts`."""
    assert pool.num_workers == 1
    before = pool.stats()["restarts"]
    clean = _listing(pool)  # what an untouched slot shows (tier A: the runtime's /dev nodes)
    job.setdefault("timeout_s", 10)
    t0 = time.monotonic()
    (res,) = pool.run([SandboxJob(code=textwrap.dedent(code), **job)])
    print(f"[tier {pool.tier}] {res.status} {time.monotonic() - t0:.2f}s "
          f"out={res.stdout[-400:]!r} err={res.stderr[-400:]!r}")
    after = _listing(pool)
    assert pool.stats()["restarts"] - before == restarts, (pool.stats(), res)
    for d in ("/tmp", "/dev/shm", "/dev"):  # nothing the hostile job wrote is visible
        assert after[d] == clean[d], f"{d} after the hostile job: {after[d]} (clean: {clean[d]})"
    assert after["."] == [], after
    return res, after


# --- finding: files a job leaves, where the wipe lacked permission -------------------------------

LOCKED = """
import os
def attempt(what, fn):
    try:
        fn()
        print(what, "ok")
    except OSError as e:
        print(what, "denied", e.errno)
def plant(d):
    os.makedirs(d + "/locked/inner")
    for p in (d + "/locked/secret", d + "/locked/inner/secret", d + "/top-secret"):
        with open(p, "w") as f:
            f.write("LEAK")
    os.chmod(d + "/locked/inner", 0o500)
    os.chmod(d + "/locked", 0o500)
for d in ("/tmp", "/dev/shm", "."):
    attempt("plant " + d, lambda d=d: plant(d))
attempt("write /dev", lambda: open("/dev/jaxrl-leak", "w").write("LEAK"))
attempt("mkdir /dev", lambda: os.mkdir("/dev/jaxrl-leak-dir"))
attempt("chmod job dir", lambda: os.chmod(".", 0o500))
"""


def test_locked_dirs_and_dev_do_not_leak(slot):
    res, _ = run_then_ordinary(slot, LOCKED)
    assert res.status == "ok", res
    assert "plant . ok" in res.stdout, res.stdout


def test_locked_scratch_root_is_restored(slot):
    """A job that takes the write bit off /tmp and /dev/shm themselves (tier A: it owns them)."""
    code = """
        import os
        for d in ("/tmp", "/dev/shm"):
            try:
                os.chmod(d, 0o500)
                print("chmod", d, "ok")
            except OSError as e:
                print("chmod", d, "denied", e.errno)
    """
    res, _ = run_then_ordinary(slot, code)
    assert res.status == "ok", res
    (r,) = slot.run([SandboxJob(code="import os\nfor d in ('/tmp', '/dev/shm'):\n"
                                     "    open(d + '/x', 'w').write('x')\nprint('wrote')")])
    assert r.status == "ok" and r.stdout == "wrote\n", r


MARK_DIRS = """
import os
for d in ("/tmp", "/dev/shm", os.path.dirname(os.getcwd())):
    try:
        os.setxattr(d, "user.leak", b"LEAK")
        print("xattr", d)
    except OSError as e:
        print("xattr denied", d, e.errno)
    try:
        os.utime(d, ns=(123456789123456789, 987654321987654321))
        print("utime", d)
    except OSError as e:
        print("utime denied", d, e.errno)
"""

READ_MARKS = """
import os
for d in ("/tmp", "/dev/shm", os.path.dirname(os.getcwd())):
    st = os.stat(d)
    print(d, os.listxattr(d), st.st_atime_ns, st.st_mtime_ns)
"""


def test_scratch_dir_metadata_does_not_carry(slot):
    """xattrs and times of the scratch dirs (tier A: the job owns them) are a message to the next
    job unless put back."""
    res, _ = run_then_ordinary(slot, MARK_DIRS)
    assert res.status == "ok", res
    (r,) = slot.run([SandboxJob(code=READ_MARKS)])
    assert r.status == "ok", r
    assert "leak" not in r.stdout, r.stdout
    assert "123456789123456789" not in r.stdout and "987654321987654321" not in r.stdout, r.stdout


FILL = """
import os
def fill(d):
    os.makedirs(d + "/locked")
    n = 0
    try:
        while n < 40:  # at most 40 x 32 MiB, far above the scratch caps
            with open("%s/locked/%d" % (d, n), "wb") as f:
                for _ in range(32):
                    f.write(b"\\0" * (1 << 20))
            n += 1
    except OSError as e:
        print("full", d, n, e.errno)
    os.chmod(d + "/locked", 0o500)
for d in ("/tmp", "/dev/shm"):
    fill(d)
"""


def test_filled_locked_scratch_does_not_break_later_jobs(slot):
    res, _ = run_then_ordinary(slot, FILL, memory_mb=256)
    assert res.stdout.count("full") == 2, res  # both scratch spaces were filled to their caps
    for _ in range(2):  # and later jobs keep working, not only the first one
        _listing(slot)


def test_deeply_nested_dirs_are_wiped(slot):
    code = """
        import os
        home = os.getcwd()
        for top in (home, "/tmp", "/dev/shm"):
            os.chdir(top)
            for i in range(5000):
                os.mkdir("d")
                os.chdir("d")
            os.chmod(".", 0o500)  # the deepest level locked too
            os.chdir(home)
        print("nested")
    """
    res, _ = run_then_ordinary(slot, code, timeout_s=20)
    assert res.status == "ok" and "nested" in res.stdout, res


# --- finding: the zygote did unbounded work for the job (compiling its source) --------------------


def _zygote_hwm_mb(pool) -> float:
    pid = pool._slots[0].zygote_pids()[-1]  # read-only use of private state, for the zygote pid
    with open(f"/proc/{pid}/status") as f:
        return int(re.search(r"^VmHWM:\s+(\d+) kB", f.read(), re.M).group(1)) / 1024


def test_huge_source_is_compiled_under_the_job_limits(slot):
    source = "x = [" + "1," * 1_500_000 + "]\nprint('compiled')\n"  # 3 MB: ~1 GB to compile
    hwm0 = _zygote_hwm_mb(slot)
    t0 = time.monotonic()
    res, _ = run_then_ordinary(slot, source, memory_mb=128, timeout_s=3)
    wall = time.monotonic() - t0
    assert res.status in ("oom", "timeout", "error"), res
    assert "compiled" not in res.stdout
    hwm = _zygote_hwm_mb(slot)
    assert hwm < max(hwm0, 30) + 20, f"the zygote grew to {hwm:.0f} MiB (from {hwm0:.0f})"
    assert wall < 3 + 6, f"{wall:.1f} s"


# --- finding: tier B's seccomp checked socket() only ----------------------------------------------


class _HostDatagramSockets:
    """An abstract and a path AF_UNIX datagram socket on the host; the path one in a
    world-accessible directory outside /tmp (so tier B's private /tmp does not hide it)."""

    def __init__(self):
        self.abstract_name = f"jaxrl-hostile-dgram-{secrets.token_hex(4)}"
        self.abstract = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.abstract.bind("\0" + self.abstract_name)
        self.dir = os.path.join(os.getcwd(), f".jaxrl-sock-{secrets.token_hex(4)}")
        os.mkdir(self.dir)
        os.chmod(self.dir, 0o777)
        self.path = os.path.join(self.dir, "s")
        self.named = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        self.named.bind(self.path)
        os.chmod(self.path, 0o777)
        for s in (self.abstract, self.named):
            s.setblocking(False)

    def received(self) -> list[bytes]:
        got = []
        for s in (self.abstract, self.named):
            while True:
                try:
                    got.append(s.recv(4096))
                except BlockingIOError:
                    break
        return got

    def close(self):
        self.abstract.close()
        self.named.close()
        shutil.rmtree(self.dir, ignore_errors=True)


SOCKET_JOB = """
import socket
targets = [{abstract!r}, {path!r}]
def attempt(what, fn):
    try:
        fn()
        print(what, "SENT")
    except OSError as e:
        print(what, "denied", e.errno)
def pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0]
for t in targets:
    attempt("sendto " + t[:6], lambda t=t: pair().sendto(b"from-job", t))
    attempt("sendmsg " + t[:6], lambda t=t: pair().sendmsg([b"from-job"], [], 0, t))
    def connect_send(t=t):
        s = pair()
        s.connect(t)
        s.send(b"from-job")
    attempt("connect " + t[:6], connect_send)
    attempt("socket " + t[:6], lambda t=t: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
            .sendto(b"from-job", t))
try:
    pair().bind("\\0jaxrl-job-bound")  # tier A: its own network namespace
    print("bound")
except OSError as e:
    print("bind denied", e.errno)
a, b = socket.socketpair()  # an unnamed pair stays usable (asyncio's self-pipe needs it)
a.send(b"ping")
print("pair", b.recv(4))
"""


def test_host_datagram_sockets_receive_nothing(slot):
    host = _HostDatagramSockets()
    try:
        code = SOCKET_JOB.format(abstract="\0" + host.abstract_name, path=host.path)
        res, _ = run_then_ordinary(slot, code)
        time.sleep(0.1)
        got = host.received()
    finally:
        host.close()
    assert got == [], f"tier {slot.tier}: host sockets received {got}\n{res.stdout}"
    assert "SENT" not in res.stdout, res.stdout
    assert res.status == "ok" and "pair b'ping'" in res.stdout, res


def test_asyncio_runs(slot):
    code = "import asyncio\nasync def f():\n    await asyncio.sleep(0.01)\n    return 7\n" \
           "print(asyncio.run(f()))"
    (r,) = slot.run([SandboxJob(code=code)])
    assert r.status == "ok" and r.stdout == "7\n", r


TALKER = """
import ctypes, socket, time
libc = ctypes.CDLL(None, use_errno=True)
name = "\\0jaxrl-hostile-talk-" + {tag!r}
path = "/tmp/jaxrl-hostile-talk-" + {tag!r}
def pair():
    return socket.socketpair(socket.AF_UNIX, socket.SOCK_DGRAM)[0]
if {role!r} == "listen":
    socks = []
    for addr in (name, path):
        for make in (pair, lambda: socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)):
            try:
                s = make()
                s.bind(addr)
                libc.connect(s.fileno(), bytes(16), 16)  # AF_UNSPEC: drop a pair's peer
                s.setblocking(False)
                socks.append(s)
            except OSError as e:
                print("bind denied", e.errno)
    end = time.monotonic() + 1.5
    while time.monotonic() < end:
        for s in socks:
            try:
                print("GOT", s.recv(100))
            except BlockingIOError:
                pass
        time.sleep(0.01)
else:
    time.sleep(0.3)
    for addr in (name, path):
        for _ in range(5):
            try:
                pair().sendto(b"hello", addr)
                print("SENT")
            except OSError as e:
                print("send denied", e.errno)
            time.sleep(0.05)
"""


@pytest.mark.parametrize("tier", ["A", "B"])
def test_concurrent_jobs_cannot_talk(tier):
    if tier == "A" and (why := _tier_a_reason()):
        pytest.skip(f"tier A (user namespaces via bwrap) unavailable here: {why}")
    with LocalSandboxPool(num_workers=2, tier=tier) as pool:
        tag = secrets.token_hex(4)
        jobs = [SandboxJob(code=TALKER.format(tag=tag, role=role), timeout_s=10)
                for role in ("listen", "talk")]
        listener, talker = pool.run(jobs)
        print(f"[tier {tier}]", listener.stdout, talker.stdout)
        assert listener.status == "ok" and talker.status == "ok", (listener, talker)
        assert "GOT" not in listener.stdout, f"tier {tier}: {listener.stdout}"
        ordinary = pool.run([SandboxJob(code="print(6 * 7)")] * 4)  # both slots, afterwards
        assert [r.stdout for r in ordinary] == ["42\n"] * 4, ordinary
        assert pool.stats()["restarts"] == 0


# --- finding: a tier-B job and its setsid children outlived a SIGKILLed owner --------------------

OWNER = """
import sys, time
from jaxrl.sandbox import LocalSandboxPool, SandboxJob
job = SandboxJob(timeout_s=60, code='''
import os, time
if os.fork() == 0:
    os.setsid()
    if os.fork() == 0:
        os.execv("/bin/sleep", ["sleep", "{mark}"])
    os._exit(0)
os.execv("/bin/sleep", ["sleep", "{mark}"])
''')
with LocalSandboxPool(num_workers=1, tier={tier!r}) as pool:
    print("UIDS", pool.slot_uids, flush=True)
    pool.run([job])
"""


def _sleepers(mark: str) -> list[int]:
    out = []
    for p in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{p}/cmdline", "rb") as f:
                if f.read() == b"sleep\0" + mark.encode() + b"\0":
                    out.append(int(p))
        except OSError:
            pass
    return out


@pytest.mark.parametrize("user", ["host", "rootless"])
@pytest.mark.parametrize("how", ["owner", "group"])
@pytest.mark.parametrize("tier", ["A", "B"])
def test_no_job_outlives_a_killed_owner(tier, how, user):
    """SIGKILL of the owning process alone, or of its whole process group (a shell's or a batch
    system's kill, `timeout -s KILL`): every process of the running job is gone within 5 s. As
    this machine's user, and as root of a user namespace that maps only itself (no uid switch:
    the zygote sweeps its reparented descendants)."""
    if tier == "A" and (why := _tier_a_reason()):
        pytest.skip(f"tier A (user namespaces via bwrap) unavailable here: {why}")
    prefix = []
    if user == "rootless":
        if shutil.which("unshare") is None or subprocess.run(
                ["unshare", "--user", "--map-root-user", "true"]).returncode != 0:
            pytest.skip("util-linux `unshare` with user namespaces is not available")
        prefix = ["unshare", "--user", "--map-root-user"]
    mark = f"{50 + secrets.randbelow(9)}.{secrets.randbelow(10**6):06d}"
    owner = subprocess.Popen([*prefix, sys.executable, "-c", OWNER.format(tier=tier, mark=mark)],
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        deadline = time.monotonic() + 30
        while len(_sleepers(mark)) < 2 and time.monotonic() < deadline:
            assert owner.poll() is None, "the owner exited early"
            time.sleep(0.05)
        assert len(_sleepers(mark)) == 2, "the job did not start its two sleepers"
        if how == "owner":
            owner.send_signal(signal.SIGKILL)
        else:
            os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(10)
        deadline = time.monotonic() + 5
        while _sleepers(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _sleepers(mark)
    finally:
        if owner.poll() is None:
            owner.kill()
        for pid in _sleepers(mark):  # leave the host clean whatever happened
            os.kill(pid, signal.SIGKILL)
        owner.stdout.close()
    assert not left, f"tier {tier}: job processes outlived their SIGKILLed pool owner: {left}"


@pytest.mark.parametrize("tier", ["A", "B"])
def test_job_tree_dies_when_the_command_pipe_closes(tier):
    """The other way an owner goes: the zygote's command pipe closes mid-job (no signal)."""
    if tier == "A" and (why := _tier_a_reason()):
        pytest.skip(f"tier A (user namespaces via bwrap) unavailable here: {why}")
    plan = pool_mod.probe(tier)
    lease = pool_mod.UidLease() if plan.root else None
    mark = f"{50 + secrets.randbelow(9)}.{secrets.randbelow(10**6):06d}"
    code = OWNER.split("'''")[1].format(mark=mark)
    z = pool_mod.ZygoteProcess(plan, lease.uid if lease else None)
    got: list = []
    runner = threading.Thread(target=lambda: got.append(z.run(SandboxJob(code, timeout_s=60))))
    try:
        runner.start()
        deadline = time.monotonic() + 20
        while len(_sleepers(mark)) < 2 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert len(_sleepers(mark)) == 2, "the job did not start its two sleepers"
        z.proc.stdin.close()
        runner.join(10)
        deadline = time.monotonic() + 5
        while _sleepers(mark) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = _sleepers(mark)
    finally:
        z.kill()
        for pid in _sleepers(mark):
            os.kill(pid, signal.SIGKILL)
        if lease:
            lease.release()
    assert got == [None] and z.failure == "died", got
    assert not left, f"tier {tier}: job processes outlived their zygote's command pipe: {left}"

