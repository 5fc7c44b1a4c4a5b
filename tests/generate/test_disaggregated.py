"""Prefill/decode disaggregation: the same greedy tokens as one colocated generator mesh, the
prefix lands on the decode devices, both weight copies follow `set_params`, the KV transfer is
logged, and `generate.prefill_devices` is validated."""

import jax
import numpy as np
import pytest

from jaxrl.config import ConfigError, RunConfig
from jaxrl.config.sections import GenerateConfig, MeshConfig
from jaxrl.generate import JaxEngine, SamplingParams, Scheduler, sample
from jaxrl.generate.disaggregated import (
    DisaggregatedEngine,
    decode_mesh_shape,
    split_generator_mesh,
)
from jaxrl.models import create_model
from jaxrl.sharding import make_mesh
from jaxrl.testing import tiny_model_config

PROMPTS = [[1, 2, 3], [9] * 12, list(range(30, 46)), [4, 5, 6, 7, 8] * 2]  # one bucket: 16
GREEDY = SamplingParams(max_tokens=10, temperature=0.0, n=2)
KW = dict(num_slots=4, max_len=48, chunk_steps=4, max_stop_ids=4)


@pytest.fixture(scope="module")
def engines():
    model = create_model(tiny_model_config(), seed=3)
    mesh = make_mesh((2, 2), "generator", jax.devices()[4:])  # dp 2 x tp 2
    prefill_mesh, decode_mesh = split_generator_mesh(mesh, 2)
    return (JaxEngine(model, mesh=mesh, **KW),
            DisaggregatedEngine(model, prefill_mesh=prefill_mesh, mesh=decode_mesh, **KW))


def test_split_takes_whole_dp_rows():
    mesh = make_mesh((4, 2), "generator", jax.devices())
    pre, dec = split_generator_mesh(mesh, 2)
    assert pre.devices.shape == (1, 2) and dec.devices.shape == (3, 2)
    assert list(pre.devices.flat) + list(dec.devices.flat) == list(jax.devices())
    for bad in (0, 1, 3, 8):  # not a multiple of tp, or nothing left to decode
        with pytest.raises(ValueError, match=rf"prefill_devices={bad}.*valid: \[2, 4, 6\]"):
            split_generator_mesh(mesh, bad)


def test_prefix_moves_to_the_decode_devices(engines):
    colocated, disagg = engines
    tokens = PROMPTS[2]
    ref = colocated.prefill(colocated.params, tokens)
    got = disagg.prefill(disagg.params, tokens)
    decode_devices = set(disagg.mesh.devices.flat)
    for leaf in jax.tree.leaves(got):
        assert leaf.sharding.device_set == decode_devices
    np.testing.assert_allclose(np.asarray(got.logits_V), np.asarray(ref.logits_V), atol=1e-5)
    for a, b in zip(jax.tree.leaves(got.cache), jax.tree.leaves(ref.cache), strict=True):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5)
    seconds, nbytes = disagg.last_kv_transfer
    cfg = tiny_model_config()
    head_dim = cfg.hidden_size // cfg.num_heads
    # k and v per layer [1, 16, kv_heads, head_dim] f32, logits [V] f32, three int32 (the
    # cache's lengths_B[1], true_length, version)
    want = cfg.num_layers * 2 * 16 * cfg.num_kv_heads * head_dim * 4 + cfg.vocab_size * 4 + 3 * 4
    assert seconds > 0 and nbytes == want


def test_greedy_tokens_equal_colocated_through_the_scheduler(engines):
    colocated, disagg = engines
    sched = Scheduler(disagg)
    for p in PROMPTS:
        sched.submit(p, GREEDY)
    got = sorted(sched.run(), key=lambda c: (c.request_id, c.sample_index))
    want = sample(colocated, PROMPTS, GREEDY)
    assert len(got) == len(want) == len(PROMPTS) * GREEDY.n
    for g, w in zip(got, want, strict=True):
        assert g.tokens == w.tokens and g.finish_reason == w.finish_reason
        np.testing.assert_allclose(g.logprobs, w.logprobs, atol=1e-5)
    metrics = sched.stats.metrics()
    assert metrics["gen/kv_transfer_s"] > 0
    assert metrics["gen/kv_transfer_bytes"] > 0 and sched.stats.kv_transfers == len(PROMPTS)
    assert "gen/kv_transfer_s" not in Scheduler(colocated).stats.metrics()


def test_set_params_updates_both_groups(engines):
    colocated, disagg = engines
    other = create_model(tiny_model_config(), seed=11)
    before = [c.tokens for c in sample(disagg, PROMPTS[:2], GREEDY)]
    try:
        for e in engines:
            e.set_params(other, version=1)
        assert int(disagg.prefill_engine.params.version) == 1
        got = sample(disagg, PROMPTS[:2], GREEDY)
        want = sample(colocated, PROMPTS[:2], GREEDY)
        assert [c.tokens for c in got] == [c.tokens for c in want] != before
        assert all(v == 1 for c in got for v in c.versions)  # prefill's version too
    finally:
        for e in engines:
            e.set_params(create_model(tiny_model_config(), seed=3), version=0)


def test_prefill_devices_config_errors():
    with pytest.raises(ConfigError, match=r"generate.prefill_devices.*got -1"):
        GenerateConfig(prefill_devices=-1)
    mesh = MeshConfig(trainer=(4, 1), generator=(2, 2))
    with pytest.raises(ConfigError, match=r"prefill_devices=3 .* valid: \[2\]"):
        RunConfig(mesh=mesh, generate=GenerateConfig(prefill_devices=3))
    with pytest.raises(ConfigError, match=r"prefill_devices=4 .* valid: \[2\]"):
        RunConfig(mesh=mesh, generate=GenerateConfig(prefill_devices=4))
    assert RunConfig(mesh=mesh, generate=GenerateConfig(prefill_devices=2))


def test_a_run_builds_the_split_generator_and_publishes_to_both_groups():
    from flax import nnx

    from jaxrl.rl.sync import build_generator
    from jaxrl.sharding import make_meshes

    cfg = RunConfig(mesh=MeshConfig(trainer=(4, 1), generator=(2, 2)),
                    generate=GenerateConfig(prefill_devices=2, num_slots=3))
    meshes = make_meshes(cfg.mesh)
    params = nnx.to_pure_dict(nnx.state(create_model(tiny_model_config(), mesh=meshes.trainer)))
    gen = build_generator(cfg, tiny_model_config(), meshes.generator, params, seq_len=20,
                          version=0, eos_id=1, multi=False)
    publisher, engine, sched = gen.publisher, gen.engine, gen.scheduler
    rows = meshes.generator.devices
    assert isinstance(engine, DisaggregatedEngine) and sched.engine is engine
    assert list(engine.prefill_mesh.devices.flat) == list(rows[0])
    assert list(engine.mesh.devices.flat) == list(rows[1])
    assert engine.num_slots == 3  # rounded to the decode group's dp (1), not the mesh's (2)
    new = jax.tree.map(lambda x: x + 1, params)
    sched.set_params(publisher.publish(new, 1)[0], 1)
    for side in (engine, engine.prefill_engine):
        leaves = jax.tree.leaves(side.params.state)
        assert {d for x in leaves for d in x.sharding.device_set} == set(side.mesh.devices.flat)
        for got, want in zip(leaves, jax.tree.leaves(new), strict=True):
            np.testing.assert_array_equal(np.asarray(got), np.asarray(want))
        assert int(side.params.version) == 1


def test_decode_mesh_shape_is_what_the_split_leaves():
    assert decode_mesh_shape((4, 2), 2) == (3, 2) and decode_mesh_shape((4, 1), 3) == (1, 1)
    assert decode_mesh_shape((4, 2), 0) == (4, 2)  # colocated
    assert decode_mesh_shape((4, 2), 3) == (4, 2)  # invalid: split_generator_mesh says why
    mesh = make_mesh((4, 2), "generator", jax.devices())
    assert split_generator_mesh(mesh, 4)[1].devices.shape == decode_mesh_shape((4, 2), 4)
