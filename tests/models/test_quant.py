"""Int8 for the generator (`jaxrl.models.quant`, `generate.quantize="int8"` and `"w8a8"`)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import MeshConfig
from jaxrl.models import create_model, quant
from jaxrl.models.model import abstract_model
from jaxrl.presets import tiny_model_config
from jaxrl.sharding import make_meshes

# Greedy logits of the int8 generator against the f32 model it was quantized from, on the tiny
# model (2 layers, random init): |f32 - int8| <= LOGIT_ATOL. Measured ~1.5e-3; the bound
# allows growth with a changed init, not a wrong scale (which moves logits by O(0.1)).
LOGIT_ATOL = 1e-2


@pytest.mark.parametrize("shape,n", [((48, 4, 8), 1), ((4, 8, 48), 2)])
def test_round_trip_error_per_channel_is_at_most_half_a_scale(shape, n):
    lead = (1,) * (len(shape) - 1)
    w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.01, 3.0, shape[-1]).reshape(
        lead + (-1,))
    w = w.at[..., 0].set(0.0)  # an all-zero output channel
    q, scale = quant.quantize_int8(w, n)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == shape[n:]
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) <= 127
    err = jnp.abs(quant.dequantize(q, scale) - w)
    bound = (scale / 2 * (1 + 1e-6)).reshape((1,) * n + scale.shape)  # + f32 rounding
    assert bool(jnp.all(err <= bound)), float(jnp.max(err - bound))
    assert float(scale[..., 0].max()) == 1.0 and not bool(jnp.any(q[..., 0]))
    # absmax per channel: each channel's largest weight is represented exactly (+-127)
    assert bool(jnp.all(jnp.max(jnp.abs(q.astype(jnp.int32)), axis=tuple(range(n)))[..., 1:]
                        == 127))


def test_int8_einsum_is_the_einsum_of_the_dequantized_weight():
    x = jax.random.normal(jax.random.key(1), (2, 3, 4, 8))
    q, scale = quant.quantize_int8(jax.random.normal(jax.random.key(2), (4, 8, 16)), 2)
    got = quant.int8_einsum("bthd,hde->bte", x, q, scale)
    want = jnp.einsum("bthd,hde->bte", x, quant.dequantize(q, scale))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


def test_int8_generator_greedy_logits_are_close_and_behaviour_logprobs_are_its_own():
    from jaxrl.generate import SamplingParams, sample

    cfg = tiny_model_config()
    model = create_model(cfg, seed=0)
    q_model = quant.int8_copy(model)
    assert model.layers[0].attn.q_proj[...].dtype == jnp.float32
    leaves = nnx.to_pure_dict(nnx.state(q_model))["layers"][0]
    assert leaves["attn"]["q_proj"].dtype == jnp.int8
    assert leaves["mlp"]["down_proj_scale"].shape == (cfg.hidden_size,)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    outs = sample(q_model, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, c in zip(prompts, outs, strict=True):
        seq = jnp.asarray([prompt + c.tokens])
        lq, lf = q_model(seq)[0], model(seq)[0]
        assert float(jnp.max(jnp.abs(lq - lf))) <= LOGIT_ATOL
        # the engine decodes the int8 model: its greedy tokens and behaviour logprobs are the
        # int8 model's own (what the off-policy corrections see), not the f32 model's
        pos = np.arange(len(prompt) - 1, seq.shape[1] - 1)
        np.testing.assert_array_equal(np.asarray(jnp.argmax(lq[pos], -1)), c.tokens)
        logp = jax.nn.log_softmax(lq[pos], -1)[np.arange(len(pos)), np.asarray(c.tokens)]
        np.testing.assert_allclose(np.asarray(logp), c.logprobs, atol=1e-4)


@pytest.mark.parametrize("lora_generator", [None, "merge", "forward"])
def test_publish_quantizes_the_generator_copy_on_its_mesh(lora_generator):
    """The full sync and both LoRA publish paths hand the engine int8 projections sharded on the
    generator mesh, each within half a scale of the weight the trainer's model uses (merged
    adapters included); the trainer's params stay f32."""
    import dataclasses

    from jaxrl.config import LoraConfig
    from jaxrl.controller.build import int8_quantizer, lora_publisher
    from jaxrl.controller.weight_sync import GeneratorPublisher, WeightSync
    from jaxrl.models import lora
    from jaxrl.sharding import pure_state_shardings

    cfg = tiny_model_config()
    if lora_generator:
        cfg = dataclasses.replace(cfg, lora=LoraConfig(rank=4, alpha=8.0,
                                                       generator=lora_generator))
    meshes = make_meshes(MeshConfig(trainer=(2, 1), generator=(1, 2)))
    params = nnx.to_pure_dict(nnx.state(create_model(cfg, mesh=meshes.trainer, seed=0)))
    want = params
    if lora_generator:
        base, adapters = lora.split(params)
        adapters = jax.tree.map(lambda x: x + 0.05, adapters)
        publisher, graphdef = lora_publisher(cfg, meshes.generator, base, None, int8=True)
        state, metrics = publisher.publish(adapters, version=1)
        want = lora.merge(lora.join(base, adapters), cfg.lora) if lora_generator == "merge" \
            else base
    else:
        graphdef, abstract = nnx.split(abstract_model(cfg))
        sync = WeightSync(pure_state_shardings(abstract, meshes.generator, "generator"))
        publisher = GeneratorPublisher(sync, nnx.graphdef(abstract_model(cfg, int8=True)),
                                       int8_quantizer(cfg, meshes.generator, graphdef))
        state, metrics = publisher.publish(params, version=1)
    assert ("pipeline/quantize_s" in metrics) == (lora_generator != "forward")  # base: once
    got = nnx.to_pure_dict(state)
    assert lora.has_adapters(got) == (lora_generator == "forward")
    for module, name in (("attn", "q_proj"), ("attn", "o_proj"), ("mlp", "up_proj")):
        q, scale = got["layers"][0][module][name], got["layers"][0][module][f"{name}_scale"]
        assert q.dtype == jnp.int8 and set(q.sharding.device_set) == set(
            meshes.generator.devices.flat)
        w = np.asarray(want["layers"][0][module][name])
        err = np.abs(np.asarray(quant.dequantize(q, scale)) - w)
        assert np.all(err <= np.asarray(scale) / 2 * (1 + 1e-6) + 1e-7)
    assert got["layers"][0]["attn"]["q_proj"].sharding.spec[1] == "tp"
    assert params["layers"][0]["attn"]["q_proj"].dtype == jnp.float32


def test_memory_plan_counts_the_int8_copy_by_hand():
    from jaxrl.config import GenerateConfig, ModelConfig, RunConfig
    from jaxrl.train.memory_plan import plan_memory

    # E 64, F 128, 2 layers, 4 heads x D 16, 2 kv heads, V 128, tied: 82240 params
    model = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=False)
    cfg = RunConfig(model=model, generate=GenerateConfig(num_slots=8, max_len=64,
                                                         quantize="int8"))
    plan = plan_memory(cfg, model, trainer_mesh_shape=(1, 1), generator_mesh_shape=(1, 1),
                       max_seq_len=48, platform="cpu", budget_bytes=2**30)
    # per layer: projections q 4096 + k 2048 + v 2048 + o 4096 + mlp 3 * 8192 in int8, scales
    # 64 + 32 + 32 + 64 + 128 + 128 + 64 in f32; embedding + norms 8192 + 5 * 64 in f32
    int8 = 2 * 36864 + 2 * 512 * 4 + (8192 + 320) * 4
    assert plan.item("weights").bytes == 4 * 82240 + int8  # + the synced f32 copy


def _w8a8_reference(spec, x, q, scale, n):
    """w8a8 by hand in float64 numpy: each token (the input's leading axes) scaled by its own
    absmax over the `n` contracted trailing axes, rounded to int8, contracted with the int8
    weight, then both scales applied."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).reshape(x.shape[:x.ndim - n] + (-1,)).max(-1)
    t = np.where(amax > 0, amax / 127, 1.0)
    p = np.clip(np.round(x / t.reshape(t.shape + (1,) * n)), -127, 127)
    out = np.einsum(spec, p, np.asarray(q, np.float64))
    return out * t.reshape(t.shape + (1,) * (out.ndim - t.ndim)) * np.asarray(scale, np.float64)


@pytest.mark.parametrize("spec,xs,ws,n", [("bte,ef->btf", (2, 3, 16), (16, 24), 1),
                                          ("bthd,hde->bte", (2, 3, 4, 8), (4, 8, 16), 2),
                                          ("bte,ekd->btkd", (2, 3, 16), (16, 2, 8), 1)])
def test_w8a8_einsum_is_int8_activations_times_int8_weights(spec, xs, ws, n):
    x = jax.random.normal(jax.random.key(3), xs) * 3.0
    x = x.at[0, 0].set(0.0)  # an all-zero token: scale 1, output 0
    q, scale = quant.quantize_int8(jax.random.normal(jax.random.key(4), ws), n)
    got = quant.int8_einsum(spec, x, q, scale, activations=True)
    want = _w8a8_reference(spec, x, q, scale, n)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[0, 0]))
    # and it is a close approximation of the unquantized product (per-token rounding only)
    plain = np.einsum(spec, np.asarray(x, np.float64), np.asarray(quant.dequantize(q, scale)))
    assert np.max(np.abs(np.asarray(got) - plain)) < 0.05 * np.max(np.abs(plain))
    # the contraction itself runs on int8 operands with int32 sums
    hlo = jax.jit(lambda a: quant.int8_einsum(spec, a, q, scale, activations=True)).lower(
        x).as_text()
    assert any("dot_general" in line and "xi8>" in line and "xi32>" in line
               for line in hlo.splitlines())


def test_w8a8_refuses_a_spec_whose_tokens_do_not_lead():
    q, scale = quant.quantize_int8(jax.random.normal(jax.random.key(5), (16, 8)), 1)
    with pytest.raises(ValueError, match="w8a8 needs.*'etb,ef->btf'"):
        quant.int8_einsum("etb,ef->btf", jnp.ones((16, 3, 2)), q, scale, activations=True)


def test_w8a8_generator_greedy_logits_are_close_to_f32_and_its_own():
    """`quantize_int8(activations=True)` keeps weight-only int8's weights and adds per-token
    activation rounding: logits stay near the f32 model's; the engine's greedy tokens and
    behaviour logprobs are the w8a8 model's own."""
    from jaxrl.generate import SamplingParams, sample

    cfg = tiny_model_config()
    model = create_model(cfg, seed=0)
    w8 = quant.int8_copy(model)
    w8a8 = quant.int8_copy(model, activations=True)
    assert w8a8.layers[0].attn.int8_activations and w8a8.layers[0].mlp.int8_activations
    assert not w8.layers[0].attn.int8_activations
    for a, b in zip(jax.tree.leaves(nnx.state(w8)), jax.tree.leaves(nnx.state(w8a8)),
                    strict=True):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b))  # the same weights
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    outs = sample(w8a8, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, c in zip(prompts, outs, strict=True):
        seq = jnp.asarray([prompt + c.tokens])
        lq, lw, lf = w8a8(seq)[0], w8(seq)[0], model(seq)[0]
        assert float(jnp.max(jnp.abs(lq - lf))) <= 2 * LOGIT_ATOL
        assert float(jnp.max(jnp.abs(lq - lw))) > 0  # activations are rounded too
        pos = np.arange(len(prompt) - 1, seq.shape[1] - 1)
        np.testing.assert_array_equal(np.asarray(jnp.argmax(lq[pos], -1)), c.tokens)
        logp = jax.nn.log_softmax(lq[pos], -1)[np.arange(len(pos)), np.asarray(c.tokens)]
        np.testing.assert_allclose(np.asarray(logp), c.logprobs, atol=1e-4)


def test_a_run_config_with_w8a8_builds_a_w8a8_generator():
    from jaxrl.config import GenerateConfig, RunConfig
    from jaxrl.controller.build import generator

    cfg = tiny_model_config()
    run_cfg = RunConfig(model=cfg, generate=GenerateConfig(num_slots=4, max_len=32,
                                                           quantize="w8a8"))
    mesh = make_meshes(MeshConfig(trainer=(1, 1), generator=(1, 1))).generator
    params = nnx.to_pure_dict(nnx.state(create_model(cfg, seed=0)))
    _, engine, _ = generator(run_cfg, cfg, mesh, params, seq_len=16, version=0, eos_id=0,
                             multi=False)
    model = nnx.merge(engine.graphdef, engine.params.state)
    assert model.layers[0].attn.q_proj[...].dtype == jnp.int8
    assert model.layers[0].attn.int8_activations and model.layers[0].mlp.int8_activations
