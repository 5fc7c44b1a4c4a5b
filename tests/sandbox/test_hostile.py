"""Hostile programs against the sandbox pool, in every tier this machine offers: resource
exhaustion, processes that try to outlive their job, reward hacks through `code_tests`.

Isolation (network, secrets, host files, IPC, privileges, concurrent jobs) is in
test_hostile_isolation.py, one-slot findings (wipe, compile cost, sockets, owner death) in
test_hostile_slot.py; the shared fixture and `run_hostile` checks are in hostile_helpers.py.
"""

# ruff: noqa: F811 - `pool` is the fixture imported from hostile_helpers, taken as an argument

from __future__ import annotations

import os
import re
import secrets
import stat
import textwrap
import time

import pytest
from hostile_helpers import (  # noqa: F401 - pool: the fixture
    SandboxJob,
    _host_paths_absent,
    _normal_job_ok,
    _pool_processes,
    _private_tmp,
    _zygote_processes,
    pool,
    run_hostile,
)

from jaxrl.rewards.rewards import get_reward


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


def test_pool_is_intact_after_the_suite(pool):
    assert pool.num_workers == 2
    results = pool.run([SandboxJob(code=f"print({i})") for i in range(8)])
    assert [r.stdout.strip() for r in results] == [str(i) for i in range(8)]
    assert all(r.status == "ok" for r in results)
    assert stat.S_IMODE(os.stat("/tmp").st_mode) & 0o1000  # the host /tmp kept its sticky bit
