"""jaxrl.distributed in one process: cluster detection, shards, metric reduction, meshes."""

import jax
import pytest

from jaxrl import distributed as D
from jaxrl.config import ConfigError, DistConfig, MeshConfig


def test_cluster_requested_only_by_settings_or_cluster_env():
    assert not D.cluster_requested(DistConfig(), environ={})
    assert D.cluster_requested(DistConfig(coordinator="h:1", num_processes=2, process_id=0),
                               environ={})
    assert D.cluster_requested(DistConfig(), environ={"JAX_COORDINATOR_ADDRESS": "h:1"})
    assert not D.cluster_requested(DistConfig(), environ={"SLURM_JOB_ID": "7"})  # one task
    assert D.cluster_requested(DistConfig(), environ={"SLURM_JOB_ID": "7", "SLURM_NTASKS": "4"})
    assert not D.cluster_requested(DistConfig(), environ={"TPU_WORKER_HOSTNAMES": "localhost"})
    assert D.cluster_requested(DistConfig(), environ={"TPU_WORKER_HOSTNAMES": "a,b"})


def test_single_process_needs_no_initialisation():
    assert D.maybe_initialize(DistConfig()) is False
    assert D.is_leader() and not D.multi_process()
    assert D.allgather_objects({"a": [1]}) == [{"a": [1]}]


def test_shard_bounds_cover_every_item_once():
    for n in (0, 1, 4, 7):
        for count in (1, 2, 3):
            spans = [D.shard_bounds(n, i, count) for i in range(count)]
            assert spans[0][0] == 0 and spans[-1][1] == n
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:], strict=False))
            assert max(b - a for a, b in spans) - min(b - a for a, b in spans) <= 1


def test_reduce_metrics_sums_counters_maxes_maxima_averages_the_rest():
    rows = [{"reward/mean": 0.5, "reward/items_scored": 16.0, "staleness/max": 1.0,
             "data/prompts_consumed": 4.0, "pipeline/mode": "sync", "gen/tokens_per_s": 10.0},
            {"reward/mean": 1.0, "reward/items_scored": 16.0, "staleness/max": 2.0,
             "data/prompts_consumed": 4.0, "pipeline/mode": "sync", "gen/tokens_per_s": 30.0}]
    out = D.reduce_metrics(rows)
    assert out == {"reward/mean": 0.75, "reward/items_scored": 32.0, "staleness/max": 2.0,
                   "data/prompts_consumed": 8.0, "pipeline/mode": "sync",
                   "gen/tokens_per_s": 40.0}


def test_process_meshes_in_one_process():
    meshes = D.process_meshes(MeshConfig())  # 8 local devices: 4 train, 4 generate
    assert meshes.trainer.shape == {"fsdp": 4, "tp": 1}
    assert meshes.generator.shape == {"dp": 4, "tp": 1}
    assert not set(meshes.trainer.devices.flat) & set(meshes.generator.devices.flat)
    colo = D.process_meshes(MeshConfig(colocated=True, generator=(2, 1)))
    assert colo.trainer.size == jax.device_count() and colo.generator.size == 2
    with pytest.raises(ConfigError, match="must use exactly the 6 trainer devices"):
        D.process_meshes(MeshConfig(trainer=(2, 1), generator=(2, 1)))
    with pytest.raises(ConfigError, match="per process"):
        D.process_meshes(MeshConfig(generator=(8, 1)))
