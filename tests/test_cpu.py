"""`mesh.cpu_cores="split"`: disjoint host cores for the trainer and the generator (jaxrl/cpu.py).

What is checked against the operating system: which cores each client's threads may run on
(`/proc/self/task`, `os.sched_getaffinity`), which threads do the generator's work (per-thread
CPU time), and that arrays placed and computed on the generator's client give the same values
as numpy and as the default client. Also: `return_free_memory` against the process's RSS.
"""

import os
import subprocess
import sys
import threading

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from jaxrl import cpu
from jaxrl.config import ConfigError, MeshConfig
from jaxrl.sharding import make_meshes

needs_split = pytest.mark.skipif(
    cpu.split_unavailable() is not None,
    reason=f"mesh.cpu_cores='split' unavailable here: {cpu.split_unavailable()}",
)


def _native_threads() -> set[int]:
    python = {t.native_id for t in threading.enumerate()}
    return {int(t) for t in os.listdir("/proc/self/task")} - python


def _default_pool() -> set[int]:
    """The default client's intra-op pool: XLA names its threads `tf_XLAEigen`."""
    out = set()
    for t in _native_threads() - cpu._CLIENT_THREADS:
        try:
            with open(f"/proc/self/task/{t}/comm") as f:
                if f.read().strip() == "tf_XLAEigen":
                    out.add(t)
        except OSError:
            pass
    return out


def _cpu_seconds(tids) -> float:
    total = 0
    for t in tids:
        try:
            with open(f"/proc/self/task/{t}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            total += int(fields[11]) + int(fields[12])  # utime + stime, in clock ticks
        except OSError:
            pass
    return total / os.sysconf("SC_CLK_TCK")


@pytest.fixture(autouse=True)
def _restore_shared():
    yield
    make_meshes(MeshConfig(cpu_cores="shared"))  # leave no pinning behind for other tests


def test_split_cores_is_proportional_and_leaves_each_role_one():
    assert cpu.split_cores(1, 1, [0, 1]) == ([0], [1])
    assert cpu.split_cores(4, 4, [3, 5, 6, 7]) == ([3, 5], [6, 7])
    assert cpu.split_cores(6, 2, list(range(8))) == ([0, 1, 2, 3, 4, 5], [6, 7])
    assert cpu.split_cores(7, 1, [0, 1]) == ([0], [1])  # never an empty share
    assert cpu.split_cores(1, 7, [0, 1]) == ([0], [1])
    with pytest.raises(ValueError, match="at least 2 cores"):
        cpu.split_cores(1, 1, [0])


def test_bad_value_names_the_valid_ones():
    with pytest.raises(ConfigError, match="cpu_cores.*'sharred'.*'shared'"):
        MeshConfig(cpu_cores="sharred")
    with pytest.raises(ValueError, match="valid choices"):
        cpu.check_cpu_cores("separate")
    cpu.check_cpu_cores("shared")
    assert MeshConfig().cpu_cores == "shared"


def test_a_mode_this_host_cannot_run_fails_before_any_work(monkeypatch):
    monkeypatch.setattr(cpu, "split_unavailable", lambda: "no affinity on this OS")
    with pytest.raises(ConfigError, match="cpu_cores='split'.*no affinity.*use 'shared'"):
        make_meshes(MeshConfig(cpu_cores="split"))
    make_meshes(MeshConfig(cpu_cores="shared"))  # shared needs nothing


def test_shared_and_colocated_use_the_default_client():
    for cfg in (MeshConfig(colocated=True), MeshConfig(cpu_cores="shared")):
        meshes = make_meshes(cfg)
        assert {d.client for d in meshes.generator.devices.flat} == {jax.devices()[0].client}
    assert list(make_meshes(MeshConfig()).generator.devices.flat) == jax.devices()[4:]


@needs_split
def test_split_pins_each_role_to_its_own_cores_and_shared_undoes_it():
    full = os.sched_getaffinity(0)
    trainer_cores, generator_cores = cpu.split_cores(4, 4)
    meshes = make_meshes(MeshConfig(cpu_cores="split"))
    trainer, generator = list(meshes.trainer.devices.flat), list(meshes.generator.devices.flat)
    assert trainer == jax.devices()[:4]
    assert len(generator) == 4 and all(d.platform == "cpu" for d in generator)
    assert generator[0].client is not jax.devices()[0].client
    assert not (set(trainer) & set(generator)) and not meshes.colocated
    # the generator's client: its own threads, on its cores only
    alive = cpu._CLIENT_THREADS & _native_threads()
    assert alive and all(os.sched_getaffinity(t) == set(generator_cores) for t in alive)
    # the trainer's (default) client: its pool on the other cores
    pool = _default_pool()
    assert pool and all(os.sched_getaffinity(t) == set(trainer_cores) for t in pool)
    assert os.sched_getaffinity(0) == full  # the controller's own thread stays free
    make_meshes(MeshConfig(cpu_cores="shared"))
    assert all(os.sched_getaffinity(t) == full for t in _default_pool())


@needs_split
def test_arrays_move_and_compute_across_the_two_clients():
    meshes = make_meshes(MeshConfig(trainer=(2, 2), generator=(1, 4), cpu_cores="split"))
    x = np.random.default_rng(0).standard_normal((8, 16)).astype(np.float32)
    on_trainer = jax.device_put(x, NamedSharding(meshes.trainer, P("fsdp", "tp")))
    target = NamedSharding(meshes.generator, P(None, "tp"))
    on_generator = jax.device_put(on_trainer, target)
    assert on_generator.sharding == target
    np.testing.assert_array_equal(np.asarray(on_generator), x)
    f = jax.jit(lambda a: jnp.tanh(a) @ a.T)
    np.testing.assert_allclose(np.asarray(f(on_generator)), np.tanh(x) @ x.T,
                               rtol=1e-5, atol=1e-5)
    # the same program on the same layout gives the same bits on either client
    rep_t = jax.device_put(x, NamedSharding(meshes.trainer, P()))
    rep_g = jax.device_put(x, NamedSharding(meshes.generator, P()))
    np.testing.assert_array_equal(np.asarray(f(rep_g)), np.asarray(f(rep_t)))
    back = jax.device_put(f(on_generator), NamedSharding(meshes.trainer, P()))
    assert back.sharding.mesh.devices.flat[0].client is jax.devices()[0].client


@needs_split
def test_generator_work_runs_on_the_generator_clients_threads():
    meshes = make_meshes(MeshConfig(cpu_cores="split"))
    x = jax.device_put(np.ones((768, 768), np.float32), NamedSharding(meshes.generator, P()))
    f = jax.jit(lambda a: jnp.tanh(a @ a) @ a)
    f(x).block_until_ready()
    _, generator_cores = cpu.split_cores(4, 4)
    ours = {t for t in _native_threads()
            if t in cpu._CLIENT_THREADS or os.sched_getaffinity(t) == set(generator_cores)}
    theirs = _default_pool()
    g0, d0 = _cpu_seconds(ours), _cpu_seconds(theirs)
    for _ in range(20):
        f(x).block_until_ready()
    g, d = _cpu_seconds(ours) - g0, _cpu_seconds(theirs) - d0
    assert g > 0.2 and d < 0.25 * g, (g, d)


_HEAP_HOLES = """
import ctypes, sys
from jaxrl.cpu import return_free_memory
libc = ctypes.CDLL(None)
libc.malloc.restype = ctypes.c_void_p
libc.free.argtypes = [ctypes.c_void_p]
rss = lambda: int(open("/proc/self/statm").read().split()[1]) * 4096
blocks = [libc.malloc(64 << 10) for _ in range(800)]  # 50 MiB of small blocks: the heap
for b in blocks:
    ctypes.memset(b, 1, 64 << 10)
for b in blocks[:-1]:  # the last block keeps the top of the heap: the rest is a hole
    libc.free(b)
before = rss()
ok = return_free_memory()
print(ok, before - rss())
"""


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc_trim")
def test_return_free_memory_gives_heap_holes_back_to_the_os():
    out = subprocess.run([sys.executable, "-c", _HEAP_HOLES], capture_output=True, text=True,
                         check=True).stdout.split()
    assert out[0] == "True"
    assert int(out[1]) > 40 << 20  # most of the 50 MiB hole left the RSS
