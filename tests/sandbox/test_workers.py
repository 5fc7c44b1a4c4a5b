"""KillableWorkers: fresh, light interpreters that survive crashes and memory blow-ups; the
sandbox runtime they and the zygotes come from imports neither jax nor the rewards above it."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from jaxrl.sandbox.workers import KillableWorkers, RewardTimeout, WorkerError


@pytest.fixture(scope="module")
def workers():
    with KillableWorkers(2, preload=("sympy",)) as w:
        yield w


def _modules_in_worker():
    return "jax" in sys.modules, "sympy" in sys.modules


def test_workers_are_light_and_preloaded(workers):
    # Fresh interpreters: no jax (the test process has it), sympy preloaded before any call.
    assert workers.map(_modules_in_worker, [()], timeout_s=10) == [(False, True)]


def test_killable_workers_recover_from_crash_and_memory(workers):
    outs = workers.map(os._exit, [(3,)], timeout_s=5)
    assert isinstance(outs[0], WorkerError) and not isinstance(outs[0], RewardTimeout)
    outs = workers.map(bytearray, [(8 << 30,)], timeout_s=5)  # over the 2 GiB RLIMIT_AS
    assert isinstance(outs[0], WorkerError) and "MemoryError" in str(outs[0])
    assert workers.map(len, [("abc",)] * 5, timeout_s=5) == [3] * 5


def test_the_runtime_imports_neither_jax_nor_the_rewards():
    probe = ("import sys, jaxrl.sandbox, jaxrl.sandbox.ray_pool\n"
             "print(sorted(m for m in sys.modules if m.split('.')[0] in ('jax', 'numpy')"
             " or m.startswith('jaxrl.rewards')))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
