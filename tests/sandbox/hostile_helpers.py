"""Shared fixture and checks of the hostile suite (test_hostile*.py).

Each hostile program bounds itself (a deadline, a budget) so that it stops on its own even if the
sandbox failed to stop it; the pool's limits are set well below those bounds. After each one
`run_hostile` asserts that nothing reached the host, that no process outlived the job, that a
normal job on the same pool still succeeds, and that the pool kept its size. The `pool` fixture is
parametrised over tiers A (bubblewrap + namespaces) and B (uid + rlimits + seccomp); the tier is in
each test id. Only loopback addresses are ever targeted.
"""

from __future__ import annotations

import collections
import os
import re
import secrets
import shutil
import subprocess
import textwrap
import time

import pytest

from jaxrl.sandbox import LocalSandboxPool, SandboxJob

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
    """An ordinary job succeeds on every slot: one per slot, each busy long enough (0.2 s) that
    the slots take one each (so the slot that ran the hostile job runs one too)."""
    code = "import os, time\ntime.sleep(0.2)\nprint(6 * 7, sorted(os.listdir('.')))"
    for r in pool.run([SandboxJob(code=code, timeout_s=10)] * pool.num_workers):
        assert r.status == "ok" and r.stdout.split() == ["42", "[]"], r


def run_hostile(
    pool,
    code: str,
    *,
    timeout_s: float = 2.0,
    memory_mb: int = 256,
    max_wall_s=20.0,
    stdin: str = "",
    restarts: int = 0,
):
    """Runs one hostile job; checks bounded return, no survivors, that an ordinary job then
    succeeds on every slot, the pool's size, and that `restarts` zygotes were replaced."""
    size = pool.num_workers
    before = _pool_processes(pool)
    restarts_before = pool.stats()["restarts"]
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
    assert pool.stats()["restarts"] - restarts_before == restarts, pool.stats()
    return res


def _host_paths_absent(*paths: str) -> None:
    for p in paths:
        assert not os.path.lexists(p), f"sandboxed job left {p} on the host"
