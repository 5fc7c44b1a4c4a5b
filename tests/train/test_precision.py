"""Mixed precision: bf16 compute with f32 master weights and f32 optimizer state still learns."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.config import TrainConfig
from jaxrl.train.batch import make_batch
from jaxrl.train.trainer import Trainer


def test_precision_resolution():
    auto = TrainConfig()
    assert auto.precision("float32", "float32", "cpu") == ("float32", "float32")
    assert auto.precision("float32", "float32", "gpu") == ("float32", "bfloat16")
    assert auto.precision("float32", "float32", "tpu") == ("float32", "bfloat16")
    forced = TrainConfig(compute_dtype="bfloat16", param_dtype="float32")
    assert forced.precision("bfloat16", "float32", "cpu") == ("float32", "bfloat16")


def test_bf16_compute_f32_master_weights_learn_the_token_bandit(model_cfg, mesh, train_cfg):
    cfg = dataclasses.replace(train_cfg, compute_dtype="bfloat16", param_dtype="float32")
    tr = Trainer(model_cfg, cfg, mesh)
    assert tr.model_cfg.dtype == "bfloat16" and tr.model_cfg.param_dtype == "float32"
    floats = [x for x in jax.tree.leaves((tr.state.params, tr.state.opt_state))
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert floats and all(x.dtype == jnp.float32 for x in floats)  # master weights + Adam state

    prompt = (np.arange(15) * 7 % 128).astype(np.int32)

    def rewarded_mass():
        from flax import nnx

        model = nnx.merge(tr.graphdef, tr.state.params)
        logits = model(jnp.asarray(prompt[None]))[0, -1].astype(jnp.float32)
        return float(jnp.sum(jax.nn.softmax(logits)[:16])), logits

    p0, _ = rewarded_mass()
    for step in range(15):
        _, logits = rewarded_mass()
        key = jax.random.fold_in(jax.random.key(0), step)
        answers = np.asarray(jax.random.categorical(key, logits, shape=(8,)))
        tokens = np.concatenate([np.tile(prompt, (8, 1)), answers[:, None]], axis=1)
        mask = np.zeros(tokens.shape, np.float32)
        mask[:, -1] = 1
        last = tr.step(make_batch(tokens, mask, (answers < 16).astype(np.float32),
                                  np.repeat(np.arange(2), 4)))
    p1, _ = rewarded_mass()
    assert p1 > max(3 * p0, 0.5), f"rewarded probability went {p0:.3f} -> {p1:.3f}"
    assert np.isfinite(last["loss/total"])
    floats = [x for x in jax.tree.leaves((tr.state.params, tr.state.opt_state))
              if jnp.issubdtype(x.dtype, jnp.floating)]
    assert all(x.dtype == jnp.float32 for x in floats)  # still f32 after the updates
