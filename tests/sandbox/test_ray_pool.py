"""RaySandboxPool on a local `ray.init(num_cpus=2)`: the same basic behaviour as the local pool.

Skipped only when ray cannot be imported (install the `ray` extra: pip install 'jaxrl[ray]').
"""

from __future__ import annotations

import concurrent.futures
import os
import re
import time

import pytest

ray = pytest.importorskip("ray", reason="ray is not installed (pip install 'jaxrl[ray]')")

from jaxrl.rewards import RaySandboxPool, SandboxJob  # noqa: E402
from jaxrl.sandbox import pool as pool_mod  # noqa: E402

pytestmark = pytest.mark.slow  # a local Ray cluster takes ~10-20 s to start on 2 busy cores


def _uid_processes(uids) -> list[int]:
    out = []
    for d in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{d}/status") as f:
                st = f.read()
        except OSError:
            continue
        m = re.search(r"^Uid:\s+(\d+)", st, re.M)
        if m and int(m.group(1)) in uids and not re.search(r"^State:\s+Z", st, re.M):
            out.append(int(d))
    return out


@pytest.fixture(scope="module")
def ray_session():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False,
             configure_logging=False)
    yield
    ray.shutdown()


def _tiers() -> list[str]:
    try:
        pool_mod.probe("A")
        return ["A", "B"]
    except RuntimeError:
        return ["B"]


@pytest.fixture(scope="module", params=["A", "B"])
def pool(request, ray_session):
    if request.param not in _tiers():
        pytest.skip("tier A (user namespaces via bwrap) unavailable on this machine")
    with RaySandboxPool(tier=request.param) as p:
        assert p.tier == request.param and p.num_workers == 2
        yield p
        uids = set(p.slot_uids)
    time.sleep(0.5)
    assert not _uid_processes(uids), "sandbox processes outlived RaySandboxPool.close()"


def test_basic_statuses(pool):
    jobs = [
        SandboxJob(code="import sys\nprint(sys.stdin.read().upper(), open('f.txt').read())",
                   stdin="hi", files={"f.txt": "file"}),
        SandboxJob(code="raise ValueError('boom')"),
        SandboxJob(code="import time; time.sleep(60)", timeout_s=0.5),
        SandboxJob(code="while True: pass", timeout_s=0.5),
        SandboxJob(code="x = bytearray(512 << 20)", memory_mb=96),
        SandboxJob(code="while True: print('y' * 1000)", max_output_bytes=10_000),
    ]
    t0 = time.monotonic()
    rs = pool.run(jobs)
    assert time.monotonic() - t0 < 20
    assert [r.status for r in rs] == ["ok", "error", "timeout", "timeout", "oom", "output_limit"]
    assert rs[0].stdout == "HI file\n" and "ValueError: boom" in rs[1].stderr


def test_many_jobs_in_order_and_submit(pool):
    fut = pool.submit([SandboxJob(code=f"print({i} * 2)") for i in range(40)])
    assert isinstance(fut, concurrent.futures.Future)
    rs = fut.result(timeout=60)
    assert [r.stdout for r in rs] == [f"{i * 2}\n" for i in range(40)]
    assert all(r.queue_s >= 0 and r.start_s >= 0 and r.wall_s >= 0 for r in rs)
    assert pool.run([]) == []


def test_stats(pool):
    st = pool.stats()
    assert st["tier"] == pool.tier and st["workers"] == 2 and st["jobs"] > 0
    assert {"queue_wait_s_p50", "exec_s_p50", "start_s_p50", "timeouts", "restarts"} <= set(st)


def test_dead_actor_is_replaced(pool):
    before = pool.stats()["restarts"]
    ray.kill(pool._actors[0])
    rs = pool.run([SandboxJob(code=f"print({i})") for i in range(8)])
    assert [r.stdout for r in rs] == [f"{i}\n" for i in range(8)]
    assert pool.num_workers == 2 and pool.stats()["restarts"] == before + 1
