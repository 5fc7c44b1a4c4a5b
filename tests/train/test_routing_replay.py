"""Routing replay (R3, arXiv:2510.11370) end to end on a tiny Qwen3-MoE: the engine records the
experts of every prompt and fed token, rollouts carry them into `Batch.routed_experts`, and the
trainer replays them (`train.routing_replay`) or measures `moe/routing_mismatch` against them."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ModelConfig
from jaxrl.generate import SamplingParams, sample
from jaxrl.models import create_model
from jaxrl.models.moe import routing_mismatch
from jaxrl.rl.buffer import Group, Rollout, groups_to_batch
from jaxrl.sharding import make_mesh
from jaxrl.train.config import TrainConfig
from jaxrl.train.logprobs import model_logprobs_routed
from jaxrl.train.trainer import Trainer

MOE = ModelConfig(architecture="qwen3_moe", qk_norm=True, num_experts=8, experts_per_token=2,
                  moe_intermediate_size=16, num_layers=3, mlp_only_layers=(1,), vocab_size=64,
                  hidden_size=32, intermediate_size=32, num_heads=2, num_kv_heads=1,
                  head_dim=16)
PROMPTS = [[1, 5, 9, 2], [7, 3, 3, 8, 4, 6]]


def _groups(model, n=2, max_tokens=6):
    out = sample(model, PROMPTS, SamplingParams(max_tokens=max_tokens, n=n, seed=3,
                                                temperature=1.0))
    groups = [Group(example={}, rollouts=[]) for _ in PROMPTS]
    for i, c in enumerate(out):
        groups[i // n].rollouts.append(Rollout(
            prompt=c.prompt, completion=c.tokens, logprobs=c.logprobs, versions=c.versions,
            finish_reason=c.finish_reason, reward=float(i % 2), routing=c.routing))
    return out, groups


def _metrics(trainer, batch):
    return trainer.step(batch)


@pytest.fixture(scope="module")
def recorded():
    model = create_model(MOE)
    completions, groups = _groups(model)
    return model, completions, groups


def test_the_engine_records_each_tokens_experts(recorded):
    model, completions, groups = recorded
    for c in completions:
        n = len(c.prompt) + len(c.tokens)
        assert c.routing.shape == (2, n, 2) and c.routing.dtype == np.int8  # 2 sparse layers
        assert np.all(c.routing[:, -1] == -1)  # the last token is sampled, never fed
        assert np.all((c.routing[:, :-1] >= 0) & (c.routing[:, :-1] < 8))
    # the recorded routing is the model's own on the whole sequences (f32 CPU: same sets)
    batch = groups_to_batch(groups)
    own = _own_routing(model, batch)
    rec = np.asarray(batch.routed_experts).transpose(2, 0, 1, 3)
    recorded_ = np.broadcast_to(np.all(rec >= 0, -1, keepdims=True), rec.shape)
    assert recorded_.sum() == 2 * 2 * sum(len(c.prompt) + len(c.tokens) - 1 for c in completions)
    np.testing.assert_array_equal(np.sort(own, -1)[recorded_], np.sort(rec, -1)[recorded_])


def _own_routing(model, batch, experts=None):
    run = nnx.jit(lambda m, t, p, s, ex: m.hidden_routed(t, p, s, experts_LBTK=ex)[1])
    routing = run(model, *(jnp.asarray(x) for x in (batch.tokens, batch.positions,
                                                     batch.segment_ids)), experts)
    return np.asarray(routing.experts_LBTK)


def test_replay_routes_as_recorded_and_the_router_keeps_its_gradient(recorded):
    model, _, groups = recorded
    batch = groups_to_batch(groups)
    ex = jnp.transpose(jnp.asarray(batch.routed_experts), (2, 0, 1, 3))
    # a different routing than the model's own, to see replay take it
    forced = jnp.where(ex >= 0, (ex + 3) % 8, ex)
    forced = forced.at[..., 1].set(jnp.where(ex[..., 1] >= 0, (forced[..., 0] + 1) % 8, -1))

    def loss(m):
        h, routing = m.hidden_routed(jnp.asarray(batch.tokens), jnp.asarray(batch.positions),
                                     jnp.asarray(batch.segment_ids), experts_LBTK=forced)
        return jnp.sum(h ** 2), routing

    (_, routing), grads = nnx.jit(nnx.value_and_grad(loss, has_aux=True))(model)
    used = np.asarray(routing.experts_LBTK)
    rec = np.asarray(forced)
    np.testing.assert_array_equal(used[rec >= 0], rec[rec >= 0])
    for layer in (0, 2):  # the sparse layers' routers get gradients through the gate weights
        assert np.abs(np.asarray(grads.layers[layer].mlp.router[...])).max() > 0


def test_bf16_generator_against_f32_trainer(recorded):
    """A bf16 generator routes some tokens differently from the f32 trainer: replay removes the
    difference from the trainer's forward (mismatch 0), and the router's own disagreement is
    the mismatch measured without replay. (An f32 generator records the f32 model's own routing,
    `test_the_engine_records_each_tokens_experts`, so its mismatch is 0.)"""
    model, _, _ = recorded
    gen = create_model(dataclasses.replace(MOE, dtype="bfloat16"))  # same seed: same params
    completions, groups = _groups(gen, n=4, max_tokens=12)
    batch = groups_to_batch(groups)
    # the trainer's own f32 routing of the same tokens against the bf16 record
    ls, b, t, k = batch.routed_experts.shape[2], *batch.shape, 2
    own = jnp.asarray(_own_routing(model, batch)).reshape(ls, b * t, k)
    rec = jnp.transpose(jnp.asarray(batch.routed_experts), (2, 0, 1, 3)).reshape(ls, b * t, k)
    pair, token = routing_mismatch(own, rec, jnp.asarray(batch.segment_ids).reshape(-1) > 0)
    print(f"bf16 generator vs f32 trainer: routing mismatch {float(pair):.4f} of "
          f"(layer, token) pairs, {float(token):.4f} of tokens in any layer")
    assert 0 < float(pair) < 0.5

    mesh = make_mesh((2, 1), "trainer", jax.devices()[:2])
    params = nnx.to_pure_dict(nnx.state(model))
    cfg = TrainConfig(lr=0.0, logprob_chunk=8, weight_decay=0.0, routing_replay=True)
    on = _metrics(Trainer(MOE, cfg, mesh, params=params), batch)
    assert on["moe/routing_mismatch"] == on["moe/routing_mismatch_any_layer"] == 0.0
    np.testing.assert_allclose(on["moe/router_mismatch"], float(pair), rtol=1e-5)
    # without replay (the same function the train step calls with train.routing_replay off)
    dev = jax.tree.map(jnp.asarray, batch)
    off = nnx.jit(lambda m, bt: model_logprobs_routed(m, bt, chunk=8)[2])(model, dev)
    np.testing.assert_allclose(off["moe/routing_mismatch"], float(pair), rtol=1e-5)
    np.testing.assert_allclose(off["moe/routing_mismatch_any_layer"], float(token), rtol=1e-5)
    assert "moe/router_mismatch" not in off
