"""LoRA in the trainer: step 0 is the base model, the base never changes, adapter gradients equal
those of the merged-weight model computed by autodiff, only adapters hold optimiser state."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import LoraConfig
from jaxrl.models import lora
from jaxrl.models.transformer import Transformer
from jaxrl.train.config import TrainConfig
from jaxrl.train.objective import prepare_targets
from jaxrl.train.state import model_graphdef
from jaxrl.train.step import _grads_and_stats, _micro_loss, batch_shardings
from jaxrl.train.trainer import Trainer, tree_bytes

CFG = TrainConfig(lr=1e-2, logprob_chunk=8, weight_decay=0.0)


@pytest.fixture(scope="module")
def lora_cfg(model_cfg):
    return dataclasses.replace(model_cfg, lora=LoraConfig(rank=4, alpha=8.0))


def _randomise(adapters, seed):
    """Adapters with non-zero B (a fresh adapter's B is zero, which hides half the maths)."""
    leaves, tree = jax.tree.flatten(adapters)
    keys = jax.random.split(jax.random.key(seed), len(leaves))
    return jax.tree.unflatten(tree, [0.1 * jax.random.normal(k, x.shape, x.dtype)
                                     for k, x in zip(keys, leaves, strict=True)])


def test_fresh_adapters_leave_the_model_exactly_unchanged(model_cfg, lora_cfg):
    base = Transformer(model_cfg, rngs=nnx.Rngs(3))
    with_lora = Transformer(lora_cfg, rngs=nnx.Rngs(3))
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, model_cfg.vocab_size, (2, 12)))
    np.testing.assert_array_equal(np.asarray(with_lora(tokens)), np.asarray(base(tokens)))
    params = nnx.to_pure_dict(nnx.state(with_lora))
    base_part, adapters = lora.split(params)
    jax.tree.map(np.testing.assert_array_equal, base_part, nnx.to_pure_dict(nnx.state(base)))
    # every targeted projection of every layer has its pair, and nothing else is an adapter
    per_layer = len(lora_cfg.lora.targets) * 2
    assert len(jax.tree.leaves(adapters)) == per_layer * model_cfg.num_layers
    assert lora.join(base_part, adapters).keys() == params.keys()


def test_adapter_gradients_equal_merged_weight_autodiff(lora_cfg, mesh, make_toy):
    """d loss / d (A, B) of the adapted model == autodiff through `W + s A B` of the plain
    model (an independent route: the plain model never sees an adapter)."""
    graphdef, _ = model_graphdef(lora_cfg, CFG)
    plain_graphdef, _ = model_graphdef(dataclasses.replace(lora_cfg, lora=LoraConfig()), CFG)
    params = nnx.to_pure_dict(nnx.state(Transformer(lora_cfg, rngs=nnx.Rngs(0))))
    base, adapters = lora.split(params)
    adapters = _randomise(adapters, 1)
    batch = make_toy(seed=2, b=8)
    tg, _ = prepare_targets(CFG, batch)

    got, _ = _grads_and_stats(adapters, batch, tg, graphdef=graphdef, cfg=CFG, frozen=base)

    def merged_loss(ad):
        merged = lora.merge(lora.join(base, ad), lora_cfg.lora)
        return _micro_loss(merged, batch, tg, graphdef=plain_graphdef, cfg=CFG)[0]

    want = jax.grad(merged_loss)(adapters)
    flat_got, flat_want = jax.tree.leaves(got), jax.tree.leaves(want)
    assert len(flat_got) == len(flat_want) > 0
    scale = max(float(jnp.abs(w).max()) for w in flat_want)
    for g, w in zip(flat_got, flat_want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-4, atol=1e-6 * scale)
    assert all(float(jnp.abs(g).max()) > 0 for g in flat_got)


def test_training_changes_only_adapters_and_starts_at_the_base(lora_cfg, mesh, make_toy):
    trainer = Trainer(lora_cfg, CFG, mesh)
    base_before = jax.device_get(trainer.frozen)
    adapters_before = jax.device_get(trainer.state.params)
    # the state holds adapters and their optimiser state only
    assert not lora.split(trainer.state.params)[0]
    full_bytes = sum(x.size * 4 for x in jax.tree.leaves(base_before))
    assert tree_bytes(trainer.state.params) < full_bytes / 4
    # step 0's logprobs are the base model's
    batch = trainer.prepare(make_toy(seed=0, b=8))
    plain = Trainer(dataclasses.replace(lora_cfg, lora=LoraConfig()), CFG, mesh)
    np.testing.assert_array_equal(np.asarray(trainer.logprobs(trainer.state.params, batch)),
                                  np.asarray(plain.logprobs(plain.state.params, batch)))
    for seed in range(3):
        metrics = trainer.step(make_toy(seed=seed, b=8), seed_step=seed)
    assert metrics["train/step"] == 3
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(trainer.frozen), base_before)
    moved = jax.tree.map(lambda a, b: float(np.abs(np.asarray(a) - b).max()),
                         trainer.state.params, adapters_before)
    assert all(v > 0 for v in jax.tree.leaves(moved))


def test_reference_of_a_lora_run_is_the_base(lora_cfg, mesh, make_toy):
    cfg = dataclasses.replace(CFG, kl_coef=0.1)
    trainer = Trainer(lora_cfg, cfg, mesh)
    trainer.replace_state(trainer.state.replace(params=_randomise(trainer.state.params, 4)))
    batch = trainer.prepare(make_toy(seed=1, b=8))
    plain = Trainer(dataclasses.replace(lora_cfg, lora=LoraConfig()), CFG, mesh)
    want = plain.logprobs(plain.state.params, jax.device_put(
        batch, batch_shardings(batch, mesh)))
    np.testing.assert_array_equal(np.asarray(batch.ref_logprobs), np.asarray(want))
    assert tree_bytes(trainer.ref_params) == tree_bytes(trainer.state.params)  # no base copy


def test_a_bf16_base_keeps_f32_adapters_and_optimizer_state(lora_cfg, mesh):
    cfg = dataclasses.replace(lora_cfg, param_dtype="bfloat16")
    trainer = Trainer(cfg, CFG, mesh)
    assert {x.dtype for x in jax.tree.leaves(trainer.frozen)} == {jnp.dtype(jnp.bfloat16)}
    floats = [x for x in jax.tree.leaves((trainer.state.params, trainer.state.opt_state))
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and {x.dtype for x in floats} == {jnp.dtype(jnp.float32)}
