"""Stateful tool sessions (jaxrl/sandbox/session_pool.py) with real hostile programs, tiers A and B.

Each hostile cell bounds itself (a deadline) so that it stops even if the session were not killed;
the call timeouts are far below those bounds. After each one: the session is closed and counted,
nothing it started survives, and the next session on the same (only) slot is clean.
"""

from __future__ import annotations

import os
import threading
import time

import pytest

from jaxrl.sandbox.session_pool import SessionPool
from tests.sandbox.hostile_helpers import _proc_table, _user_namespaces_work


def _pool(tier: str, slots: int) -> SessionPool:
    try:
        return SessionPool(slots, tier=tier, memory_mb=256, cpu_s=30)
    except RuntimeError as e:
        if tier == "A" and _user_namespaces_work() is not True:
            pytest.skip(f"tier A unavailable: {e}")
        raise


@pytest.fixture(scope="module", params=["A", "B"])
def pool(request):
    with _pool(request.param, 1) as p:
        yield p


def _slot_processes(pool) -> int:
    uids = set(pool.slot_uids)
    me = os.getpid()
    table = _proc_table()
    if uids:
        return sum(1 for uid, _, _ in table.values() if uid in uids)
    kids = {pid for pid, (_, ppid, _) in table.items() if ppid == me}
    return len(kids) + sum(1 for _, ppid, _ in table.values() if ppid in kids)


def _settles(pool, expected: int) -> None:
    deadline = time.monotonic() + 5.0
    while (n := _slot_processes(pool)) != expected and time.monotonic() < deadline:
        time.sleep(0.05)
    assert n == expected, f"{n - expected} processes of the session survived it"


def test_state_persists_within_a_session_only(pool):
    with pool.open() as s:
        assert s.run("x = 6\nimport os\nos.environ['MARK'] = 'm'\nopen('f', 'w').write('s')"
                     ).status == "ok"
        r = s.run("print(x * 7)\nx + 1")
        assert (r.status, r.stdout) == ("ok", "42\n7\n")
        bad = s.run("1 / 0")
        assert bad.status == "error" and "ZeroDivisionError" in bad.stderr and not bad.closed
        assert s.run("x").stdout == "6\n"  # an error keeps the session
    with pool.open() as s:
        r = s.run("import os\nprint('x' in globals(), os.environ.get('MARK'), os.listdir('.'))")
        assert (r.status, r.stdout) == ("ok", "False None []\n")


HOSTILE = {
    "sleeps_forever": ("import time\ntime.sleep(60)", "timeout"),
    "fork_bomb": ("import os, time\nt = time.monotonic()\nwhile time.monotonic() - t < 60:\n"
                  "    try:\n        os.fork()\n    except OSError:\n        pass", "timeout"),
    "forks_and_returns": ("import os, time\nfor _ in range(20):\n    if os.fork() == 0:\n"
                          "        time.sleep(60)\n        os._exit(0)\nprint('back')", None),
    "fills_output": ("import sys, time\nt = time.monotonic()\nwhile time.monotonic() - t < 60:\n"
                     "    sys.stdout.write('y' * 4096)", "output_limit"),
    "exits": ("import os\nos._exit(3)", "exited"),
    "sys_exit": ("raise SystemExit(0)", "exited"),
    "closes_its_pipes": ("import os, time\nos.close(3)\nos.close(4)\ntime.sleep(60)", None),
}


@pytest.mark.parametrize("name", sorted(HOSTILE))
def test_hostile_session_is_closed_counted_and_the_next_is_clean(pool, name):
    code, status = HOSTILE[name]
    baseline = _slot_processes(pool)
    ended_before = pool.stats()["ended_by_limit"]
    with pool.open() as s:
        s.run("secret = 'from-the-last-episode'\nopen('/tmp/left', 'w').write('x')")
        t0 = time.monotonic()
        r = s.run(code, timeout_s=1.0, max_output_bytes=1 << 14)
        assert time.monotonic() - t0 < 15, r
        if status is None:  # returned (or not): the session may go on; closing it cleans up
            assert r.status in ("ok", "timeout", "exited"), r
        else:
            assert (r.status, r.closed) == (status, True), r
            assert s.run("1").status == "closed"
            assert pool.stats()["ended_by_limit"] == ended_before + 1
    _settles(pool, baseline)
    assert pool.stats()["session_count"] == 0
    with pool.open() as s:  # the only slot: the same worker, a clean session
        r = s.run("import os\nprint('secret' in globals(), os.listdir('.'),"
                  " os.path.exists('/tmp/left'))")
        assert (r.status, r.stdout) == ("ok", "False [] False\n"), r


@pytest.mark.parametrize("tier", ["A", "B"])
def test_concurrent_sessions_are_isolated_and_served_in_order(tier):
    with _pool(tier, 2) as pool:
        a, b = pool.open(), pool.open()
        a.run("v = 'a'")
        b.run("v = 'b'")
        hog = threading.Thread(target=a.run, args=("import os\nos.kill(-1, 9)",))
        hog.start()  # a session that kills everything it can reach
        hog.join()
        assert b.run("v").stdout == "'b'\n"  # the other episode's session is untouched
        order, threads = [], []
        for i in range(3):  # b holds one slot: three waiters share the other, in arrival order
            def take(i=i):
                with pool.open(timeout_s=20) as s:
                    order.append(i)
                    s.run("import time\ntime.sleep(0.05)")
            threads.append(threading.Thread(target=take))
            threads[-1].start()
            time.sleep(0.1)
        a.close()
        for t in threads:
            t.join()
        b.close()
        assert order == [0, 1, 2]
        st = pool.stats()
        assert st["session_count"] == 0 and st["opened"] == 5, st


def test_a_slot_that_cannot_restart_is_counted_in_the_metrics(monkeypatch):
    # Its zygote dies mid-call and no new one starts: the slot goes out of service and the row
    # says so (it used to be a log line only).
    with _pool("B", 1) as pool:
        def no_zygote(i):
            raise OSError("fork: Resource temporarily unavailable")

        monkeypatch.setattr(pool, "_start", no_zygote)
        with pool.open() as s:
            pool._zygotes[0].proc.kill()
            pool._zygotes[0].proc.wait(5)
            r = s.run("1")
            assert (r.status, r.closed) == ("killed", True), r
        assert pool.stats()["restarts"] == 1
        assert pool.metrics()["sandbox/session_restart_failures"] == 1
