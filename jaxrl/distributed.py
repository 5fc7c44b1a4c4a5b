"""Multi-process JAX: initialise `jax.distributed` when the configuration or environment asks.

Explicit settings (`--dist.coordinator=host:port --dist.num_processes=N --dist.process_id=i`)
win; otherwise JAX's own cluster detection runs when a known cluster environment is present
(TPU pods, SLURM, Open MPI, Kubernetes JobSet, ...). With `pathwaysutils` installed and
configured, it is initialised first. A single process with no such environment does nothing.
"""

from __future__ import annotations

import logging
import os

import jax

from jaxrl.config import DistConfig

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
    return any(environ.get(k) for k in CLUSTER_ENV)


def maybe_initialize(cfg: DistConfig) -> bool:
    """Initialise the distributed runtime once if asked; returns whether it is multi-process."""
    global _initialized
    if _initialized or not cluster_requested(cfg):
        return jax.process_count() > 1 if _initialized else False
    try:
        import pathwaysutils  # optional: Pathways-backed JAX where it is configured

        pathwaysutils.initialize()
        log.info("pathwaysutils initialised")
    except ImportError:
        pass
    if cfg.coordinator and (cfg.num_processes is None or cfg.process_id is None):
        raise ValueError(
            "dist.coordinator is set: also set --dist.num_processes and --dist.process_id"
        )
    kwargs = {}
    if cfg.coordinator:
        kwargs = dict(coordinator_address=cfg.coordinator, num_processes=cfg.num_processes,
                      process_id=cfg.process_id)
    jax.distributed.initialize(initialization_timeout=cfg.initialization_timeout_s, **kwargs)
    _initialized = True
    log.info("jax.distributed: process %d of %d, %d devices in all",
             jax.process_index(), jax.process_count(), jax.device_count())
    return jax.process_count() > 1


def is_leader() -> bool:
    """Only process 0 writes logs, traces and run files."""
    return jax.process_index() == 0
