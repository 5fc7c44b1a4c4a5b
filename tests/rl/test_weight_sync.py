import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import MeshConfig
from jaxrl.models import create_model
from jaxrl.rl.sync import WeightSync, _chunks
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


@pytest.mark.parametrize("generator", ["merge", "forward"])
def test_lora_publish_moves_only_adapters_and_matches_the_trained_model(generator):
    """A LoRA publish moves the adapters' bytes only; the generator's model (merged weights, or
    adapters applied per forward) gives the trainer's adapted model's logits."""
    import dataclasses

    from jaxrl.config import LoraConfig
    from jaxrl.models import lora
    from jaxrl.rl.sync import lora_publisher

    cfg = dataclasses.replace(tiny_model_config(),
                              lora=LoraConfig(rank=4, alpha=8.0, generator=generator))
    meshes = make_meshes(MeshConfig(trainer=(4, 1), generator=(2, 2)))
    params = nnx.to_pure_dict(nnx.state(create_model(cfg, mesh=meshes.trainer, seed=0)))
    base, adapters = lora.split(params)
    keys = iter(jax.random.split(jax.random.key(1), 100))
    adapters = jax.tree.map(lambda x: x + 0.05 * jax.random.normal(next(keys), x.shape),
                            adapters)
    publisher, graphdef = lora_publisher(cfg, meshes.generator, base, gather=None)
    assert publisher.base_stats.bytes == sum(x.size * 4 for x in jax.tree.leaves(base))
    state, metrics = publisher.publish(adapters, version=1)
    assert metrics["pipeline/weight_sync_bytes"] == sum(
        x.size * 4 for x in jax.tree.leaves(adapters))
    gen_model = nnx.merge(graphdef, state)
    assert lora.has_adapters(nnx.to_pure_dict(state)) == (generator == "forward")
    trained = nnx.merge(nnx.graphdef(create_model(cfg)), nnx.State(lora.join(base, adapters)))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, cfg.vocab_size, (2, 10)))
    np.testing.assert_allclose(np.asarray(gen_model(tokens)), np.asarray(trained(tokens)),
                               rtol=1e-5, atol=1e-5)
    # a second publish starts again from the kept base (nothing accumulates)
    state2, _ = publisher.publish(adapters, version=2)
    jax.tree.map(np.testing.assert_array_equal, nnx.to_pure_dict(state2),
                 nnx.to_pure_dict(state))
