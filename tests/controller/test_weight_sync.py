import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import MeshConfig
from jaxrl.controller.weight_sync import WeightSync, _chunks
from jaxrl.models import create_model
from jaxrl.sharding import make_meshes, state_shardings
from jaxrl.testing import tiny_model_config


def test_chunking_bounds_each_group():
    assert _chunks([4, 4, 4, 10, 1], 8) == [[0, 1], [2], [3], [4]]
    assert _chunks([], 8) == []


@pytest.mark.parametrize("dtype", [None, "bfloat16"])
def test_reshard_trainer_params_onto_generator_mesh(dtype):
    cfg = tiny_model_config()
    meshes = make_meshes(MeshConfig(trainer=(4, 1), generator=(2, 2)))
    model = create_model(cfg, mesh=meshes.trainer, role="trainer", seed=0)
    params = nnx.state(model, nnx.Param)
    targets = state_shardings(params, meshes.generator, "generator")
    sync = WeightSync(targets, dtype=dtype, chunk_bytes=20_000)
    moved, stats = sync(params)
    src = jax.tree.leaves(params)
    dst = jax.tree.leaves(moved)
    gen_devices = set(meshes.generator.devices.flat)
    for a, b in zip(src, dst, strict=True):
        assert set(b.sharding.device_set) == gen_devices
        want = np.asarray(a.astype(dtype) if dtype else a)
        np.testing.assert_array_equal(np.asarray(b), want)
        assert b.dtype == (jnp.dtype(dtype) if dtype else a.dtype)
    q = moved["layers"][0]["attn"]["q_proj"][...]
    assert q.sharding.spec[1] == "tp"  # heads split over the generator's tp axis
    itemsize = 2 if dtype else 4
    assert stats.bytes == sum(x.size for x in src) * itemsize
    assert stats.chunks > 1 and stats.seconds > 0 and stats.gbps > 0
    # a long run syncs every step: nothing the sync keeps may grow with the number of syncs
    held = lambda: {k: len(v) for k, v in vars(sync).items() if isinstance(v, (list, dict))}
    before = held()
    for _ in range(3):
        sync(params)
    assert held() == before
