"""CPU-only machines: simulated devices, and disjoint cores for the two roles.

XLA's CPU client runs the programs of all its (simulated) devices on one shared intra-op thread
pool, so on a CPU host two "separate devices" are still the same cores: when the trainer and the
generator overlap, each slows the other down, which two accelerators would not. `mesh.cpu_cores`
chooses what the roles get:

- "shared" (the default): both roles on the default client's one pool, XLA's own behaviour.
  Fastest end to end on a small host, since whichever role runs can use every core.
- "split": the generator gets a CPU client of its own whose threads run only on its share of the
  host cores, and the default client's threads (the trainer's) are pinned to the rest: disjoint
  compute per role, the closest a CPU host gets to two devices. Each role is slower than with
  every core, but the pipeline modes overlap them as they would on accelerators, so this is the
  setting that measures the overlap on a CPU (`python launch/bench.py pipeline`). Needs Linux
  (thread affinity) and two or more cores.

Arrays move between the two clients with `jax.device_put`, as between any two devices.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import threading

CPU_CORES = ("shared", "split")

_CLIENTS: dict[tuple[int, frozenset[int]], object] = {}  # generator clients, reused
_CLIENT_THREADS: set[int] = set()  # native threads our generator clients created
_DEFAULT_MASK: dict[str, list[int]] = {}  # the default client's cores before `split` pinned them
_LOCK = threading.Lock()
log = logging.getLogger(__name__)


def simulated_device_flags(count: int | None = None) -> str:
    """XLA flags giving `count` host devices (default: 2, one for each role).

    Only meaningful before JAX initialises its backends; a real accelerator ignores it.
    """
    count = count or int(os.environ.get("JAXRL_CPU_DEVICES", "2"))
    return f"--xla_force_host_platform_device_count={count}"


def _host_cores() -> list[int]:
    return sorted(os.sched_getaffinity(0))


def split_unavailable() -> str | None:
    """Why "split" cannot work in this process, or None when it can."""
    if not hasattr(os, "sched_setaffinity") or not os.path.isdir("/proc/self/task"):
        return "pinning threads to cores needs Linux (os.sched_setaffinity, /proc/self/task)"
    if len(_host_cores()) < 2:
        return f"this process may use only {len(_host_cores())} host core"
    try:
        from jax._src.lib import xla_client

        xla_client.make_cpu_client  # noqa: B018
    except (ImportError, AttributeError):
        return "this jaxlib does not expose xla_client.make_cpu_client"
    return None


def check_cpu_cores(mode: str) -> None:
    """A clear error when `mode` is not a `mesh.cpu_cores` value or cannot work here."""
    if mode not in CPU_CORES:
        raise ValueError(
            f"mesh.cpu_cores: invalid value {mode!r}; valid choices: {list(CPU_CORES)}"
        )
    why = split_unavailable() if mode == "split" else None
    if why:
        raise ValueError(f"mesh.cpu_cores={mode!r} is not available: {why}; use 'shared'")


def split_cores(num_trainer: int, num_generator: int,
                cores: list[int] | None = None) -> tuple[list[int], list[int]]:
    """Divide `cores` (default: those this process may use) between the roles in proportion to
    their device counts, at least one each."""
    cores = _host_cores() if cores is None else sorted(cores)
    if len(cores) < 2:
        raise ValueError(f"need at least 2 cores to split between the roles, got {cores}")
    n = round(len(cores) * num_trainer / (num_trainer + num_generator))
    n = min(max(n, 1), len(cores) - 1)
    return cores[:n], cores[n:]


def role_devices(mode: str, num_trainer: int, num_generator: int) -> list | None:
    """Apply `mode` (a `mesh.cpu_cores` value, see the module docstring) for `num_trainer` and
    `num_generator` devices: returns the generator's devices for "split", or None for "shared"
    (the caller takes them from the default client), and pins or unpins the default client's
    threads to match. Raises ValueError when the mode cannot work here."""
    check_cpu_cores(mode)
    if mode == "shared":
        unpin_default_client()
        return None
    trainer_cores, generator_cores = split_cores(num_trainer, num_generator)
    try:
        devices = _generator_client_devices(num_generator, generator_cores)
    except Exception as e:  # e.g. a jaxlib whose CPU client cannot be made this way
        raise ValueError(f"mesh.cpu_cores={mode!r}: could not start the generator's CPU "
                         f"client ({type(e).__name__}: {e}); use 'shared'") from e
    _pin_default_client(trainer_cores)
    log.info("mesh.cpu_cores=split: the trainer computes on cores %s, the generator on %s",
             trainer_cores, generator_cores)
    return devices


def _generator_client_devices(num_devices: int, cores: list[int]) -> list:
    """`num_devices` devices on a CPU client of their own whose threads run only on `cores`.
    Created once per (count, cores) and reused."""
    from jax._src.lib import xla_client

    key = (num_devices, frozenset(cores))
    with _LOCK:
        client = _CLIENTS.get(key)
        if client is None:
            before = set(_thread_ids())
            mine = os.sched_getaffinity(0)
            os.sched_setaffinity(0, set(cores))  # the client's threads inherit this mask
            try:
                client = xla_client.make_cpu_client(asynchronous=True, num_devices=num_devices)
            finally:
                os.sched_setaffinity(0, mine)
            _CLIENTS[key] = client
            _CLIENT_THREADS.update(set(_thread_ids()) - before)
    return list(client.devices())


def _pin_default_client(cores: list[int]) -> None:
    import jax

    jax.devices()  # the default client (and its pool) must exist before we pin it
    with _LOCK:
        _DEFAULT_MASK.setdefault("cores", _host_cores())
        _set_default_client_affinity(cores)


def unpin_default_client() -> None:
    """Give the default client's threads back every core a "split" took from them (a no-op
    when nothing is pinned): for code that goes on in the same process after a split run."""
    with _LOCK:
        if "cores" in _DEFAULT_MASK:
            _set_default_client_affinity(_DEFAULT_MASK.pop("cores"))


def _set_default_client_affinity(cores: list[int]) -> None:
    """Pin every native (non-Python) thread that is not a generator client's: XLA's default
    client's pool and workers. Python threads run the controller and stay free."""
    python = {t.native_id for t in threading.enumerate()}
    generator_masks = {frozenset(c) for _, c in _CLIENTS}
    for tid in _thread_ids():
        if tid in python or tid in _CLIENT_THREADS:
            continue
        try:
            if frozenset(os.sched_getaffinity(tid)) in generator_masks:
                continue  # started later by a generator client's thread (inherited its mask)
            os.sched_setaffinity(tid, set(cores))
        except OSError:  # the thread ended meanwhile
            pass


def _thread_ids() -> list[int]:
    return [int(tid) for tid in os.listdir("/proc/self/task")]


def return_free_memory() -> bool:
    """Give the C heap's free pages back to the OS (glibc `malloc_trim(0)`); False where there
    is no glibc. XLA:CPU's arrays live on that heap: freed ones up to glibc's mmap threshold
    (which grows to 32 MiB as large buffers come and go) stay mapped in holes of the heap, and
    so in the process's RSS, until trimmed. Called when a `sync` run frees its generator's
    weights and KV cache for the update (`RolloutProducer.release`)."""
    global _LIBC
    if _LIBC is None:
        name = ctypes.util.find_library("c")
        try:
            libc = ctypes.CDLL(name) if name else None
            _LIBC = libc if libc is not None and hasattr(libc, "malloc_trim") else False
        except OSError:
            _LIBC = False
    if _LIBC is False:
        return False
    _LIBC.malloc_trim(0)
    return True


_LIBC = None  # ctypes handle of glibc, False where it has no malloc_trim
