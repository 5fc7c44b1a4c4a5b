"""`Processes`: everything a run does differently when several processes share it, in one place.

One process: every method is the identity (or a no-op). Several (`jax.distributed`, see
docs/scale.md): the trainer mesh spans all of them and each generates on its own devices from its
own prompt shard, so per step the scored groups are gathered into the global batch, metrics rows
are reduced to one, each process evaluates its share of the held-out records, and the data state
saved with a checkpoint holds every process's. Gathers are collectives: every process calls them
at the same point of the trainer thread.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
from pathlib import Path

import jax

from jaxrl.config import ConfigError, DataConfig, RunConfig

log = logging.getLogger("jaxrl")


class Processes:
    def __init__(self, cfg: RunConfig):
        from jaxrl.distributed import is_leader, maybe_initialize
        from jaxrl.rl.compile_ahead import use_compile_cache

        use_compile_cache(cfg.compile_cache)  # before anything compiles
        self.multi = maybe_initialize(cfg.dist)
        self.leader = is_leader()
        self.index, self.count = jax.process_index(), jax.process_count()
        if not self.leader:  # process 0 logs the run; the others only warnings and errors
            log.setLevel(max(log.getEffectiveLevel(), logging.WARNING))

    def meshes(self, mesh_cfg):
        from jaxrl.distributed import process_meshes
        from jaxrl.sharding import make_meshes

        return process_meshes(mesh_cfg) if self.multi else make_meshes(mesh_cfg)

    def data_config(self, data: DataConfig) -> DataConfig:
        """`data.prompts_per_step` is per step for the whole run: each process draws its share."""
        if self.count == 1:
            return data
        if data.prompts_per_step % self.count:
            raise ConfigError(
                f"data.prompts_per_step={data.prompts_per_step} must be a multiple of the number "
                f"of processes ({self.count}): each process draws an equal share")
        return dataclasses.replace(data, prompts_per_step=data.prompts_per_step // self.count)

    def gather(self, obj) -> list:
        """Every process's `obj`, in process order (collective)."""
        if not self.multi:
            return [obj]
        from jaxrl.distributed import allgather_objects

        return allgather_objects(obj)

    def global_groups(self, groups: list) -> list:
        """The global batch: every process's scored groups, in process order."""
        return groups if not self.multi else [g for part in self.gather(groups) for g in part]

    def reduce_metrics(self, metrics: dict) -> dict:
        """One row for the run: counters summed, the rest averaged."""
        if not self.multi:
            return metrics
        from jaxrl.distributed import reduce_metrics

        return reduce_metrics(self.gather(metrics))

    def eval_share(self, n: int) -> tuple[int, int]:
        """[start, stop) of this process's share of `n` held-out records."""
        if not self.multi:
            return 0, n
        from jaxrl.distributed import shard_bounds

        return shard_bounds(n)

    def combine_evals(self, n: int, metrics: dict) -> dict:
        """Every process's evaluation of its share -> the metrics of all the records."""
        if not self.multi:
            return metrics
        parts = [(k, m) for k, m in self.gather((n, metrics)) if k and m]
        total = sum(k for k, _ in parts)
        out: dict = {}
        for key in sorted({k for _, m in parts for k in m}):
            vals = [(k, m[key]) for k, m in parts if key in m]
            if key.endswith("/time_s"):
                out[key] = float(max(v for _, v in vals))
            elif key.endswith(("/prompts", "/reward_errors")):
                out[key] = float(sum(v for _, v in vals))
            else:
                out[key] = float(sum(k * v for k, v in vals) / max(total, 1))
        return out

    def local_params(self, params):
        """Params this process can read whole (several processes: a local replica)."""
        if not self.multi:
            return params
        from jaxrl.distributed import local_replica

        return jax.tree.map(local_replica, params)

    def check_sft_cached(self, cfg: RunConfig, model_cfg, tokenizer) -> None:
        """Several processes read the SFT warm start from its cache; they do not train it."""
        from jaxrl.train.sft import cache_key

        sft = cfg.data.sft
        if not self.multi or sft.steps == 0:
            return
        entry = Path(sft.cache_dir) / f"sft-{cache_key(model_cfg, cfg.data, tokenizer)}"
        if not (sft.cache and (entry / "meta.json").is_file()):
            raise ConfigError(
                f"a multi-process run loads the SFT warm start from its cache, and {entry} is "
                "missing: fill it once with one process and the same config "
                "(`python launch/run.py <same args> --pipeline.steps=0`), put data.sft.cache_dir "
                "on a filesystem every host reads, or set --data.sft.steps=0")

    def on_failure(self, error: BaseException) -> None:
        """Say which process failed and why, and bound the cleanup that follows (closing may
        wait on peers that are gone)."""
        if self.count > 1:
            from jaxrl.distributed import exit_after, failure_message

            if not isinstance(error, KeyboardInterrupt):
                print(failure_message(error), file=sys.stderr, flush=True)
            exit_after(60.0, f"{type(error).__name__}: {error}")
