"""Per-layer rematerialisation (`ModelConfig.remat`, jaxrl/models/remat.py): same gradients as
without it, and on XLA:CPU the compiled backward pass really keeps less (with `nnx.remat` the
CPU compiler merged the recomputation back into the forward pass and kept every layer's
activations: docs/memory.md)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import Transformer
from jaxrl.presets import tiny_model_config

DENSE = tiny_model_config(num_layers=6, hidden_size=64, intermediate_size=512)
MOE = tiny_model_config(architecture="qwen3_moe", num_layers=3, num_experts=4,
                        experts_per_token=2, moe_intermediate_size=64, qkv_bias=False)


def _loss_fn(cfg, remat):
    graphdef, state = nnx.split(Transformer(dataclasses.replace(cfg, remat=remat),
                                            rngs=nnx.Rngs(0)))

    def loss(state, tokens):
        h = nnx.merge(graphdef, state).hidden(tokens)
        return jnp.sum(jnp.sin(h) * h)  # a cotangent that differs per element

    return loss, state


@pytest.mark.parametrize("cfg", [DENSE, MOE], ids=["dense", "moe"])
def test_remat_gradients_equal_plain_backward(cfg):
    tokens = jax.random.randint(jax.random.key(1), (4, 24), 0, cfg.vocab_size)
    plain, state = _loss_fn(cfg, False)
    remat, _ = _loss_fn(cfg, True)
    g0 = jax.jit(jax.grad(plain))(state, tokens)
    g1 = jax.jit(jax.grad(remat))(state, tokens)
    for a, b in zip(jax.tree.leaves(g0), jax.tree.leaves(g1), strict=True):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), rtol=1e-5, atol=1e-6)


def test_remat_lowers_the_compiled_backward_temporaries_on_cpu():
    # 6 layers of [16, 128] tokens: each layer keeps ~16 x 128 x (2 x 512 + ...) f32 without
    # remat; with it only the layer inputs (16 x 128 x 64) and one layer's recomputation
    tokens = jnp.zeros((16, 128), jnp.int32)
    temps = {}
    for remat in (False, True):
        loss, state = _loss_fn(DENSE, remat)
        compiled = jax.jit(jax.grad(loss)).lower(state, tokens).compile()
        temps[remat] = compiled.memory_analysis().temp_size_in_bytes
    assert temps[True] < 0.5 * temps[False], temps
