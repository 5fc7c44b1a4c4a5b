"""Multi-process JAX: initialise `jax.distributed` when the configuration or environment asks.

Explicit settings (`--dist.coordinator=host:port --dist.num_processes=N --dist.process_id=i`)
win; otherwise JAX's own cluster detection runs when a known cluster environment is present
(TPU pods, SLURM, Open MPI, Kubernetes JobSet, ...). With `pathwaysutils` installed and Pathways
configured (`JAX_PLATFORMS=proxy` / `JAX_BACKEND_TARGET`), Pathways is initialised instead: one
controller sees every device, so no `jax.distributed` is needed. A single process with no such
environment does nothing.

Multi-controller layout (every process runs the same program; see docs/scale.md):

* the trainer mesh spans every process's devices (`process_meshes`); every computation on it is
  issued by every process in the same order;
* the generator mesh is process-local: each process generates on its own devices from its own
  prompt shard and scores only its own rollouts (no double scoring);
* host data crosses processes only through `allgather_objects` (the scored groups of a step, the
  data-iterator states, metrics) and parameters through `local_replica` (weight sync);
* only process 0 writes logs, metrics, traces and the run config (`is_leader`); checkpoints are
  written collectively by orbax.
"""

from __future__ import annotations

import inspect
import logging
import os
import pickle
import sys
import threading
import time
from collections.abc import Sequence

import jax
import numpy as np
from jax.experimental import multihost_utils
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.config import ConfigError, DistConfig, MeshConfig
from jaxrl.sharding import Meshes, make_mesh

log = logging.getLogger("jaxrl")

# Environment variables whose presence means "this process is part of a cluster".
CLUSTER_ENV = (
    "JAX_COORDINATOR_ADDRESS",
    "TPU_WORKER_HOSTNAMES",
    "MEGASCALE_COORDINATOR_ADDRESS",
    "SLURM_JOB_ID",
    "OMPI_COMM_WORLD_SIZE",
    "JOBSET_NAME",
)

_initialized = False


def cluster_requested(cfg: DistConfig, environ=os.environ) -> bool:
    if cfg.coordinator or (cfg.num_processes or 1) > 1:
        return True
    if environ.get("SLURM_JOB_ID") and int(environ.get("SLURM_NTASKS", "1")) <= 1:
        return False
    if environ.get("TPU_WORKER_HOSTNAMES") and "," not in environ["TPU_WORKER_HOSTNAMES"]:
        return False  # a single-host TPU VM: one process sees every chip
    return any(environ.get(k) for k in CLUSTER_ENV)


def pathways_configured(environ=os.environ) -> bool:
    return environ.get("JAX_PLATFORMS", "").startswith("proxy") or bool(
        environ.get("JAX_BACKEND_TARGET"))


def _enable_cpu_collectives() -> None:
    """Cross-process collectives on CPU devices need gloo (no-op where jax lacks the option)."""
    platforms = os.environ.get("JAX_PLATFORMS", "")
    if platforms and "cpu" not in platforms.split(","):
        return
    try:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    except (AttributeError, ValueError) as e:  # removed or renamed in this jax
        log.debug("cpu collectives option unavailable: %s", e)


def maybe_initialize(cfg: DistConfig) -> bool:
    """Initialise the distributed runtime once if asked; returns whether it is multi-process."""
    global _initialized
    if _initialized:
        return jax.process_count() > 1
    if pathways_configured():
        try:
            import pathwaysutils
        except ImportError:
            pathwaysutils = None
        if pathwaysutils is not None:
            pathwaysutils.initialize()
            _initialized = True
            log.info("pathwaysutils initialised: %d devices", jax.device_count())
            return False
    if not cluster_requested(cfg):
        return False
    if cfg.coordinator and (cfg.num_processes is None or cfg.process_id is None):
        raise ConfigError(
            "dist.coordinator is set: also set --dist.num_processes and --dist.process_id"
        )
    _enable_cpu_collectives()
    kwargs = dict(initialization_timeout=cfg.initialization_timeout_s,
                  heartbeat_timeout_seconds=cfg.heartbeat_timeout_s)
    if cfg.coordinator:
        kwargs.update(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                      process_id=cfg.process_id)
    accepted = inspect.signature(jax.distributed.initialize).parameters
    jax.distributed.initialize(**{k: v for k, v in kwargs.items() if k in accepted})
    _initialized = True
    log.info("jax.distributed: process %d of %d, %d devices in all (%d local)",
             jax.process_index(), jax.process_count(), jax.device_count(),
             jax.local_device_count())
    return jax.process_count() > 1


def initialized() -> bool:
    """Whether `maybe_initialize` started `jax.distributed` in this process."""
    return _initialized


def is_leader() -> bool:
    """Only process 0 writes logs, traces and run files."""
    return jax.process_index() == 0


def multi_process() -> bool:
    return jax.process_count() > 1


# ------------------------------------------------------------------------------------ meshes


def process_meshes(cfg: MeshConfig):
    """Trainer mesh over every process's devices, generator mesh over this process's own.

    `mesh.generator` is the per-process (dp, tp) shape; `mesh.trainer` the global (fsdp, tp)
    shape. Colocated (or one device per process): the trainer uses every device and the
    generator time-shares the first local ones. Otherwise each process gives its last
    `prod(generator)` devices to its generator and the rest to the trainer.
    """
    nproc = jax.process_count()
    local = list(jax.local_devices())
    by_process: dict[int, list] = {}
    for d in jax.devices():
        by_process.setdefault(d.process_index, []).append(d)
    counts = {len(v) for v in by_process.values()}
    if len(counts) != 1:
        raise ConfigError(f"processes have different device counts: "
                          f"{ {p: len(v) for p, v in sorted(by_process.items())} }")
    n_local = len(local)
    colocated = cfg.colocated or n_local == 1
    ng = int(np.prod(cfg.generator)) if cfg.generator else (n_local if colocated
                                                             else n_local // 2)
    gen_shape = tuple(cfg.generator) if cfg.generator else (ng, 1)
    if ng > n_local or (not colocated and ng >= n_local):
        raise ConfigError(
            f"mesh.generator {gen_shape} is per process and needs {ng} of this process's "
            f"{n_local} local devices" + ("" if colocated else " (plus at least one for the "
                                          "trainer; or set --mesh.colocated=true)"))
    per_proc_trainer = n_local if colocated else n_local - ng
    trainer_devices = [d for p in sorted(by_process)
                       for d in sorted(by_process[p], key=lambda d: d.id)[:per_proc_trainer]]
    nt = len(trainer_devices)
    trainer_shape = tuple(cfg.trainer) if cfg.trainer else (nt, 1)
    if int(np.prod(trainer_shape)) != nt:
        raise ConfigError(
            f"mesh.trainer {trainer_shape} must use exactly the {nt} trainer devices of the "
            f"{nproc} processes ({per_proc_trainer} each): in a multi-process run the trainer "
            f"mesh spans every process, e.g. --mesh.trainer={nt}x1")
    local_sorted = sorted(local, key=lambda d: d.id)
    gen_devices = local_sorted[:ng] if colocated else local_sorted[n_local - ng:]
    return Meshes(trainer=make_mesh(trainer_shape, "trainer", trainer_devices),
                  generator=make_mesh(gen_shape, "generator", gen_devices))


def shard_bounds(n: int, index: int | None = None, count: int | None = None) -> tuple[int, int]:
    """[start, stop) of this process's contiguous share of `n` items (sizes differ by <= 1)."""
    index = jax.process_index() if index is None else index
    count = jax.process_count() if count is None else count
    base, extra = divmod(n, count)
    start = index * base + min(index, extra)
    return start, start + base + (index < extra)


# ------------------------------------------------------------------------------- host data


def allgather_objects(obj) -> list:
    """Every process's `obj` (picklable), in process order, on every process. Collective: every
    process must call it at the same point of the program."""
    if jax.process_count() == 1:
        return [obj]
    payload = np.frombuffer(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL), np.uint8)
    sizes = np.asarray(multihost_utils.process_allgather(np.asarray([payload.size], np.int64)))
    sizes = sizes.reshape(-1)
    padded = np.zeros(int(sizes.max()), np.uint8)
    padded[: payload.size] = payload
    data = np.asarray(multihost_utils.process_allgather(padded))
    return [pickle.loads(data[i, : int(sizes[i])].tobytes()) for i in range(len(sizes))]


_SUM_SUFFIXES = ("_total", "/items_scored", "/errors", "/timeouts", "/prompts_consumed",
                 "/skipped_prompts", "/bad_records", "/tokens_per_s")


def reduce_metrics(rows: Sequence[dict]) -> dict:
    """One metrics row from every process's row: counters and throughputs are summed, maxima
    and wall times take the max, everything else numeric is averaged (equal-sized shards);
    non-numeric values are process 0's."""
    if len(rows) == 1:
        return dict(rows[0])
    out = dict(rows[0])
    for key in set().union(*rows):
        vals = [r[key] for r in rows if key in r]
        if not all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            continue
        if key.endswith(_SUM_SUFFIXES):
            out[key] = float(np.sum(vals))
        elif key.endswith(("/max", "/time_s")):
            out[key] = float(np.max(vals))
        else:
            out[key] = float(np.mean(vals))
    return out


# ------------------------------------------------------------------------------- parameters


def _copy(x):
    return jax.numpy.copy(x)


def local_replica(x: jax.Array) -> jax.Array:
    """A full copy of a (possibly multi-process) array on one of this process's devices.

    Collective for arrays spanning other processes (an all-gather over their mesh). The result
    never aliases `x`'s buffers (the trainer donates them to its next step)."""
    if not isinstance(x, jax.Array) or x.is_fully_addressable:
        return x
    rep = NamedSharding(x.sharding.mesh, PartitionSpec())
    return jax.jit(_copy, out_shardings=rep)(x).addressable_data(0)


# ---------------------------------------------------------------------------------- failures


def exit_after(seconds: float, reason: str) -> None:
    """Hard bound on a failing process's shutdown: print why and `os._exit(1)` after `seconds`
    unless the process ended first. Cleanup that waits on a dead peer (a barrier, a collective
    checkpoint) cannot hang it."""

    def stop():
        time.sleep(seconds)
        print(f"jaxrl process {jax.process_index()}/{jax.process_count()}: shutdown did not "
              f"finish within {seconds:.0f}s after: {reason}; exiting", file=sys.stderr,
              flush=True)
        os._exit(1)

    threading.Thread(target=stop, name="jaxrl-exit-after", daemon=True).start()


def failure_message(error: BaseException) -> str:
    text = f"{type(error).__name__}: {error}".strip()
    if len(text) > 2000:
        text = text[:2000] + " ..."
    return (f"jaxrl process {jax.process_index()} of {jax.process_count()} stopped: {text}\n"
            "In a multi-process run a failure of one process (or of its host) stops every "
            "other one: they fail at their next collective or when the coordinator misses "
            "heartbeats (dist.heartbeat_timeout_s). Look for the first process that failed.")
