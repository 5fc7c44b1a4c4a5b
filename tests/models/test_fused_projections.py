"""Fused q/k/v and gate/up projections for the generator (`Transformer.fuse_projections`).

The reference is the unfused model (tied to `transformers` by tests/models/test_hf.py): the fused
copy computes the same dots over concatenated weights, so logits agree to f32 rounding and greedy
tokens are equal."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import create_model, quant
from jaxrl.presets import tiny_model_config

# The same products summed over the same E terms, in a wider dot: XLA may block the sum
# differently, so allow f32 rounding (logits are O(1); measured differences ~1e-6).
LOGIT_ATOL = 1e-5


def _model(**overrides):
    """The tiny model with random (non-zero) q/k/v biases, so that their fusion is exercised."""
    model = create_model(tiny_model_config(**overrides), seed=0)
    key = jax.random.key(7)
    for i, layer in enumerate(model.layers):
        for name in ("q_bias", "k_bias", "v_bias") if model.cfg.qkv_bias else ():
            p = getattr(layer.attn, name)
            p[...] = 0.5 * jax.random.normal(jax.random.fold_in(key, 3 * i + len(name)), p.shape)
    return model


def _fused(model):
    return nnx.merge(*nnx.split(model)).fuse_projections()


_logits = nnx.jit(lambda model, tokens: model(tokens))


@pytest.fixture(scope="module")
def model():
    return _model()


def test_fused_greedy_tokens_and_logits_equal_the_unfused_model(model):
    from jaxrl.generate import SamplingParams, sample

    fused = _fused(model)
    cfg = model.cfg
    state = nnx.to_pure_dict(nnx.state(fused))["layers"][0]
    g = cfg.num_heads // cfg.num_kv_heads
    assert state["attn"]["qkv_proj"].shape == (cfg.hidden_size, cfg.num_kv_heads, g + 2,
                                               cfg.head_size)
    assert "q_proj" not in state["attn"] and "gate_proj" not in state["mlp"]
    assert model.layers[0].attn.q_proj[...].shape == (cfg.hidden_size, cfg.num_heads,
                                                      cfg.head_size)  # the original is kept
    tokens = jax.random.randint(jax.random.key(1), (2, 9), 0, cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(_logits(fused, tokens)),
                               np.asarray(_logits(model, tokens)), atol=LOGIT_ATOL, rtol=0)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    sp = SamplingParams(max_tokens=12, temperature=0.0)
    want = [c.tokens for c in sample(model, prompts, sp, num_slots=2, chunk_steps=12)]
    assert [c.tokens for c in sample(fused, prompts, sp, num_slots=2, chunk_steps=12)] == want


def test_fused_qk_norm_and_four_query_heads_per_kv_head():
    model = _model(architecture="qwen3", qkv_bias=False, qk_norm=True, num_heads=8,
                   num_kv_heads=2)
    tokens = jax.random.randint(jax.random.key(3), (2, 9), 0, model.cfg.vocab_size)
    np.testing.assert_allclose(np.asarray(_logits(_fused(model), tokens)),
                               np.asarray(_logits(model, tokens)), atol=LOGIT_ATOL, rtol=0)


def test_fused_int8_equals_unfused_int8(model):
    # per-output-channel scales do not depend on the layout, so fuse-then-quantize holds the
    # same int8 values and scales as quantize alone: the logits agree to f32 rounding
    tokens = jax.random.randint(jax.random.key(2), (2, 7), 0, model.cfg.vocab_size)
    fused_int8 = quant.quantized_copy(_fused(model))
    assert nnx.to_pure_dict(nnx.state(fused_int8))["layers"][0]["attn"]["qkv_proj"].dtype \
        == jnp.int8
    np.testing.assert_allclose(np.asarray(_logits(fused_int8, tokens)),
                               np.asarray(_logits(quant.quantized_copy(model), tokens)),
                               atol=LOGIT_ATOL, rtol=0)


def test_fusing_is_refused_with_lora_after_int8_and_twice(model):
    from jaxrl.config import LoraConfig

    with pytest.raises(ValueError, match="LoRA adapters"):
        create_model(tiny_model_config(lora=LoraConfig(rank=4)), seed=0).fuse_projections()
    with pytest.raises(ValueError, match=r"before quantize\(\)"):
        quant.quantized_copy(model).fuse_projections()
    with pytest.raises(ValueError, match="already fused"):
        _fused(_fused(model))


def test_publish_fuses_the_generator_copy_on_its_mesh(model):
    """A run's publish (`generate.fuse_projections`): the generator's q/k/v and gate/up are the
    trainer's, joined (checked against the trainer's arrays by hand), sharded on the generator
    mesh by kv head / mlp; the trainer's params keep their layout."""
    from jaxrl.config import MeshConfig
    from jaxrl.models.model import abstract_model
    from jaxrl.rl.sync import GeneratorPublisher, WeightSync, generator_transform
    from jaxrl.sharding import make_meshes, pure_state_shardings

    cfg, mesh = model.cfg, make_meshes(MeshConfig(trainer=(2, 1), generator=(1, 2))).generator
    params = nnx.to_pure_dict(nnx.state(model))
    graphdef, abstract = nnx.split(abstract_model(cfg))
    publisher = GeneratorPublisher(
        WeightSync(pure_state_shardings(abstract, mesh, "generator")),
        nnx.graphdef(abstract_model(cfg, fused=True)),
        generator_transform(cfg, mesh, graphdef, quantize=None, fuse=True))
    got = nnx.to_pure_dict(publisher.publish(params, version=1)[0])["layers"][1]
    want = params["layers"][1]
    qkv, k = got["attn"]["qkv_proj"], cfg.num_kv_heads
    for j in range(k):  # kv head j: query heads j*G .. (j+1)*G - 1, then its key, its value
        g = cfg.num_heads // k
        np.testing.assert_array_equal(qkv[:, j, :g], want["attn"]["q_proj"][:, j * g:(j + 1) * g])
        np.testing.assert_array_equal(qkv[:, j, g], want["attn"]["k_proj"][:, j])
        np.testing.assert_array_equal(qkv[:, j, g + 1], want["attn"]["v_proj"][:, j])
        np.testing.assert_array_equal(got["attn"]["qkv_bias"][j, g + 1], want["attn"]["v_bias"][j])
    np.testing.assert_array_equal(got["mlp"]["gate_up_proj"][:, 1], want["mlp"]["up_proj"])
    assert qkv.sharding.spec[1] == "tp" and got["mlp"]["gate_up_proj"].sharding.spec[2] == "tp"
    assert "q_proj" in params["layers"][1]["attn"]
