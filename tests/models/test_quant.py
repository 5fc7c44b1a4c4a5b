"""8-bit generators (`jaxrl.models.quant`, `generate.quantize="int8"`, `"w8a8"` and `"fp8"`)."""

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import MeshConfig
from jaxrl.models import create_model, quant
from jaxrl.presets import tiny_model_config
from jaxrl.sharding import make_meshes

# Greedy logits of the int8 generator against the f32 model it was quantized from, on the tiny
# model (2 layers, random init): |f32 - int8| <= LOGIT_ATOL. Measured ~1.5e-3; the bound
# allows growth with a changed init, not a wrong scale (which moves logits by O(0.1)).
LOGIT_ATOL = 1e-2
# fp8 rounds weights and activations to 3 mantissa bits (2^-4 relative): measured ~2.6e-2; a
# per-token scale misapplied (its square root) moves them past 0.1
FP8_LOGIT_ATOL = 8e-2


@pytest.mark.parametrize("shape,n", [((48, 4, 8), 1), ((4, 8, 48), 2)])
def test_round_trip_error_per_channel_is_at_most_half_a_scale(shape, n):
    lead = (1,) * (len(shape) - 1)
    w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.01, 3.0, shape[-1]).reshape(
        lead + (-1,))
    w = w.at[..., 0].set(0.0)  # an all-zero output channel
    q, scale = quant.quantize_weight(w, n)
    assert q.dtype == jnp.int8 and scale.dtype == jnp.float32 and scale.shape == shape[n:]
    assert int(jnp.max(jnp.abs(q.astype(jnp.int32)))) <= 127
    err = jnp.abs(quant.dequantize(q, scale) - w)
    bound = (scale / 2 * (1 + 1e-6)).reshape((1,) * n + scale.shape)  # + f32 rounding
    assert bool(jnp.all(err <= bound)), float(jnp.max(err - bound))
    assert float(scale[..., 0].max()) == 1.0 and not bool(jnp.any(q[..., 0]))
    # absmax per channel: each channel's largest weight is represented exactly (+-127)
    assert bool(jnp.all(jnp.max(jnp.abs(q.astype(jnp.int32)), axis=tuple(range(n)))[..., 1:]
                        == 127))


@pytest.mark.parametrize("shape,n", [((48, 4, 8), 1), ((4, 8, 48), 2)])
def test_fp8_weights_are_e4m3_of_the_scaled_weight_with_the_channel_max_at_448(shape, n):
    """fp8: per output channel, `max |w|` maps to e4m3's largest finite value (448, exact) and
    every weight is `w / s` rounded to e4m3 as `ml_dtypes` (an independent implementation)
    rounds it: relative error <= 2^-4 for normal values, <= 2^-10 s below them."""
    lead = (1,) * (len(shape) - 1)
    w = jax.random.normal(jax.random.key(0), shape) * jnp.linspace(0.01, 3.0, shape[-1]).reshape(
        lead + (-1,))
    w = w.at[..., 0].set(0.0).at[(0,) * (len(shape) - 1) + (1,)].set(1e-7)  # zero; subnormal
    q, scale = quant.quantize_weight(w, n, "fp8")
    assert q.dtype == jnp.float8_e4m3fn and scale.dtype == jnp.float32
    assert scale.shape == shape[n:]
    w64, s64 = np.asarray(w, np.float64), np.asarray(scale, np.float64).reshape((1,) * n
                                                                                 + scale.shape)
    amax = np.abs(w64).max(axis=tuple(range(n)))
    np.testing.assert_allclose(np.asarray(scale)[..., 1:], amax[..., 1:] / 448, rtol=3e-7)
    want = (np.asarray(w, np.float32) / np.asarray(s64, np.float32)).astype(
        ml_dtypes.float8_e4m3fn)
    np.testing.assert_array_equal(np.asarray(q).view(np.uint8), want.view(np.uint8))
    qf = np.asarray(q.astype(jnp.float32), np.float64)
    assert np.all(np.abs(qf).max(axis=tuple(range(n)))[..., 1:] == 448.0)
    err = np.abs(qf * s64 - w64)
    normal = np.abs(w64) >= 2.0**-6 * s64
    assert np.all(err[normal] <= 2.0**-4 * np.abs(w64[normal]) * (1 + 1e-6))
    assert np.all(err[~normal] <= 2.0**-10 * np.broadcast_to(s64, w.shape)[~normal] * (1 + 1e-6))
    assert float(scale[..., 0].max()) == 1.0 and not np.any(qf[..., 0])


def test_an_unknown_format_is_refused_naming_the_valid_ones():
    with pytest.raises(ValueError, match=r"invalid format 'int4'.*'int8', 'w8a8', 'fp8'"):
        quant.quantize_weight(jnp.ones((4, 4)), 1, "int4")
    with pytest.raises(ValueError, match="invalid format 'int4'"):
        create_model(tiny_model_config(), seed=0).quantize("int4")


def test_weight_only_int8_einsum_is_the_einsum_of_the_dequantized_weight():
    x = jax.random.normal(jax.random.key(1), (2, 3, 4, 8))
    q, scale = quant.quantize_weight(jax.random.normal(jax.random.key(2), (4, 8, 16)), 2)
    got = quant.quantized_einsum("bthd,hde->bte", x, q, scale, "int8")
    want = jnp.einsum("bthd,hde->bte", x, quant.dequantize(q, scale))
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("fmt,dtype,atol", [("int8", jnp.int8, LOGIT_ATOL),
                                            ("fp8", jnp.float8_e4m3fn, FP8_LOGIT_ATOL)])
def test_8bit_generator_greedy_logits_are_close_and_behaviour_logprobs_are_its_own(
        fmt, dtype, atol):
    from jaxrl.generate import SamplingParams, sample

    cfg = tiny_model_config()
    model = create_model(cfg, seed=0)
    q_model = quant.quantized_copy(model, fmt)
    assert model.layers[0].attn.q_proj[...].dtype == jnp.float32
    leaves = nnx.to_pure_dict(nnx.state(q_model))["layers"][0]
    assert leaves["attn"]["q_proj"].dtype == dtype
    assert leaves["mlp"]["down_proj_scale"].shape == (cfg.hidden_size,)
    prompts = [[1, 2, 3, 4], [5, 6, 7]]
    outs = sample(q_model, prompts, SamplingParams(max_tokens=12, temperature=0.0))
    for prompt, c in zip(prompts, outs, strict=True):
        seq = jnp.asarray([prompt + c.tokens])
        lq, lf = q_model(seq)[0], model(seq)[0]
        assert 0 < float(jnp.max(jnp.abs(lq - lf))) <= atol
        # the engine decodes the 8-bit model: its greedy tokens and behaviour logprobs are the
        # 8-bit model's own (what the off-policy corrections see), not the f32 model's
        pos = np.arange(len(prompt) - 1, seq.shape[1] - 1)
        np.testing.assert_array_equal(np.asarray(jnp.argmax(lq[pos], -1)), c.tokens)
        logp = jax.nn.log_softmax(lq[pos], -1)[np.arange(len(pos)), np.asarray(c.tokens)]
        np.testing.assert_allclose(np.asarray(logp), c.logprobs, atol=1e-4)


def _within_rounding(q, scale, w, fmt) -> bool:
    """Each weight of `dequantize(q, scale)` within its format's rounding of `w`: half a scale
    (int8), 2^-4 relative or 2^-10 scale below e4m3's normal range (fp8)."""
    err = np.abs(np.asarray(quant.dequantize(q, scale)) - w)
    s = np.asarray(scale)
    if fmt == "fp8":
        return bool(np.all(err <= np.maximum(2.0**-4 * np.abs(w), 2.0**-10 * s) * (1 + 1e-6)
                           + 1e-7))
    return bool(np.all(err <= s / 2 * (1 + 1e-6) + 1e-7))


@pytest.mark.parametrize("lora_generator,fmt", [(None, "int8"), ("merge", "int8"),
                                                ("forward", "int8"), (None, "fp8"),
                                                ("merge", "fp8")])
def test_publish_quantizes_the_generator_copy_on_its_mesh(lora_generator, fmt):
    """The full sync and both LoRA publish paths hand the engine 8-bit projections sharded on
    the generator mesh, each within its format's rounding of the weight the trainer's model uses
    (merged adapters included); the trainer's params stay f32."""
    import dataclasses

    from jaxrl.config import LoraConfig
    from jaxrl.models import lora
    from jaxrl.rl.sync import lora_publisher

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
        publisher, graphdef = lora_publisher(cfg, meshes.generator, base, None, quantize=fmt)
        state, metrics = publisher.publish(adapters, version=1)
        want = lora.merge(lora.join(base, adapters), cfg.lora) if lora_generator == "merge" \
            else base
    else:  # a run's own wiring: quantized on the trainer's devices, then moved
        from jaxrl.config import GenerateConfig, RunConfig
        from jaxrl.rl.sync import build_generator

        run_cfg = RunConfig(model=cfg, generate=GenerateConfig(num_slots=4, max_len=32,
                                                               quantize=fmt))
        publisher = build_generator(run_cfg, cfg, meshes.generator, params, seq_len=16,
                                    version=0, eos_id=0, multi=False).publisher
        state, metrics = publisher.publish(params, version=1)
    assert ("pipeline/quantize_s" in metrics) == (lora_generator != "forward")  # base: once
    got = nnx.to_pure_dict(state)
    assert lora.has_adapters(got) == (lora_generator == "forward")
    for module, name in (("attn", "q_proj"), ("attn", "o_proj"), ("mlp", "up_proj")):
        q, scale = got["layers"][0][module][name], got["layers"][0][module][f"{name}_scale"]
        assert q.dtype == {"int8": jnp.int8, "fp8": jnp.float8_e4m3fn}[fmt]
        assert set(q.sharding.device_set) == set(meshes.generator.devices.flat)
        assert _within_rounding(q, scale, np.asarray(want["layers"][0][module][name]), fmt)
    assert got["layers"][0]["attn"]["q_proj"].sharding.spec[1] == "tp"
    assert params["layers"][0]["attn"]["q_proj"].dtype == jnp.float32


@pytest.mark.parametrize("fmt", ["int8", "fp8"])
def test_memory_plan_counts_the_8bit_copy_by_hand(fmt):
    import dataclasses

    from jaxrl.config import GenerateConfig, LoraConfig, ModelConfig, RunConfig
    from jaxrl.train.memory.plan import plan_memory

    # E 64, F 128, 2 layers, 4 heads x D 16, 2 kv heads, V 128, tied: 82240 params
    model = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                        num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=False)
    cfg = RunConfig(model=model, generate=GenerateConfig(num_slots=8, max_len=64,
                                                         quantize=fmt))
    plan = plan_memory(cfg, model, trainer_mesh_shape=(1, 1), generator_mesh_shape=(1, 1),
                       max_seq_len=48, platform="cpu", budget_bytes=2**30)
    # per layer: projections q 4096 + k 2048 + v 2048 + o 4096 + mlp 3 * 8192 in 1 byte, scales
    # 64 + 32 + 32 + 64 + 128 + 128 + 64 in f32; embedding + norms 8192 + 5 * 64 in f32
    int8 = 2 * 36864 + 2 * 512 * 4 + (8192 + 320) * 4
    assert plan.item("weights").bytes == int8  # quantized before the move: no f32 copy
    # LoRA quantizes on the generator: the 8-bit model beside the f32 weights it holds anyway
    lora = dataclasses.replace(model, lora=LoraConfig(rank=4, generator="merge"))
    sizes = [plan_memory(dataclasses.replace(cfg, model=lora, generate=dataclasses.replace(
        cfg.generate, quantize=q)), lora, trainer_mesh_shape=(1, 1), generator_mesh_shape=(1, 1),
        max_seq_len=48, platform="cpu", budget_bytes=2**30).item("weights").bytes
        for q in (fmt, "none")]
    assert sizes[0] - sizes[1] == int8


@pytest.mark.parametrize("fmt,fuse", [("int8", False), ("fp8", False), ("int8", True)])
def test_a_publish_moves_only_the_8bit_copy(fmt, fuse):
    """A run's publish quantizes on the trainer's devices and moves the 8-bit copy: the bytes it
    reports are the 8-bit model's (counted by hand, a quarter-ish of the f32 model's), and the
    generator's weights are bit for bit the copy quantized where it lives."""
    from jaxrl.config import GenerateConfig, ModelConfig, RunConfig
    from jaxrl.rl.sync import build_generator

    model_cfg = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                            num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=False)
    meshes = make_meshes(MeshConfig(trainer=(2, 1), generator=(1, 2)))
    model = create_model(model_cfg, mesh=meshes.trainer, seed=0)
    params = nnx.to_pure_dict(nnx.state(model))
    run_cfg = RunConfig(model=model_cfg, generate=GenerateConfig(
        num_slots=4, max_len=32, quantize=fmt, fuse_projections=fuse))
    gen = build_generator(run_cfg, model_cfg, meshes.generator, params, seq_len=16, version=0,
                          eos_id=0, multi=False)
    publisher = gen.publisher
    state, metrics = publisher.publish(params, version=1)
    # as in test_memory_plan_counts_the_8bit_copy_by_hand: 82240 params, 73728 of them 8-bit
    assert metrics["pipeline/weight_sync_bytes"] == 2 * 36864 + 2 * 512 * 4 + (8192 + 320) * 4
    assert metrics["pipeline/quantize_s"] > 0
    got = nnx.to_pure_dict(state)
    plain = create_model(model_cfg, seed=0)
    want = nnx.to_pure_dict(nnx.state(quant.quantized_copy(
        plain.fuse_projections() if fuse else plain, fmt)))
    for (path, a), b in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        assert a.dtype == b.dtype, path
        np.testing.assert_array_equal(np.asarray(a).view(np.uint8), np.asarray(b).view(np.uint8),
                                      err_msg=str(path))
        assert set(a.sharding.device_set) <= set(meshes.generator.devices.flat), path


def _dynamic_reference(spec, x, q, scale, n, fmt):
    """w8a8 / fp8 by hand in float64 numpy: each token (the input's leading axes) scaled by its
    own absmax over the `n` contracted trailing axes (to 127, or to 448 for fp8), rounded to
    int8 (numpy) or to e4m3 (`ml_dtypes`), contracted with the 8-bit weight, then both scales
    applied."""
    x = np.asarray(x, np.float64)
    amax = np.abs(x).reshape(x.shape[:x.ndim - n] + (-1,)).max(-1)
    top = 448.0 if fmt == "fp8" else 127.0
    t = np.where(amax > 0, amax / top, 1.0)
    y = x / t.reshape(t.shape + (1,) * n)
    if fmt == "fp8":
        p = y.astype(np.float32).astype(ml_dtypes.float8_e4m3fn).astype(np.float64)
    else:
        p = np.clip(np.round(y), -127, 127)
    out = np.einsum(spec, p, np.asarray(q.astype(jnp.float32), np.float64))
    return out * t.reshape(t.shape + (1,) * (out.ndim - t.ndim)) * np.asarray(scale, np.float64)


@pytest.mark.parametrize("fmt,operand,sums", [("w8a8", "xi8>", "xi32>"),
                                              ("fp8", "xf8E4M3FN>", "xf32>")])
@pytest.mark.parametrize("spec,xs,ws,n", [("bte,ef->btf", (2, 3, 16), (16, 24), 1),
                                          ("bthd,hde->bte", (2, 3, 4, 8), (4, 8, 16), 2),
                                          ("bte,ekd->btkd", (2, 3, 16), (16, 2, 8), 1)])
def test_dynamic_einsum_is_8bit_activations_times_8bit_weights(spec, xs, ws, n, fmt, operand,
                                                               sums):
    x = jax.random.normal(jax.random.key(3), xs) * 3.0
    x = x.at[0, 0].set(0.0)  # an all-zero token: scale 1, output 0
    q, scale = quant.quantize_weight(jax.random.normal(jax.random.key(4), ws), n, fmt)
    got = quant.quantized_einsum(spec, x, q, scale, fmt)
    want = _dynamic_reference(spec, x, q, scale, n, fmt)
    np.testing.assert_allclose(np.asarray(got), want, rtol=1e-5, atol=1e-5)
    assert not np.any(np.asarray(got[0, 0]))
    # and it is a close approximation of the unquantized product (per-token rounding only)
    plain = np.einsum(spec, np.asarray(x, np.float64), np.asarray(quant.dequantize(q, scale)))
    assert np.max(np.abs(np.asarray(got) - plain)) < 0.05 * np.max(np.abs(plain))
    # the contraction itself runs on the 8-bit operands (int32 sums for int8, f32 for e4m3)
    hlo = jax.jit(lambda a: quant.quantized_einsum(spec, a, q, scale, fmt)).lower(x).as_text()
    assert any("dot_general" in line and operand in line and sums in line
               for line in hlo.splitlines())


def test_w8a8_refuses_a_spec_whose_tokens_do_not_lead():
    q, scale = quant.quantize_weight(jax.random.normal(jax.random.key(5), (16, 8)), 1)
    with pytest.raises(ValueError, match="w8a8 needs.*'etb,ef->btf'"):
        quant.quantized_einsum("etb,ef->btf", jnp.ones((16, 3, 2)), q, scale, "w8a8")


def test_w8a8_generator_greedy_logits_are_close_to_f32_and_its_own():
    """`quantize("w8a8")` keeps weight-only int8's weights and adds per-token
    activation rounding: logits stay near the f32 model's; the engine's greedy tokens and
    behaviour logprobs are the w8a8 model's own."""
    from jaxrl.generate import SamplingParams, sample

    cfg = tiny_model_config()
    model = create_model(cfg, seed=0)
    w8 = quant.quantized_copy(model, "int8")
    w8a8 = quant.quantized_copy(model, "w8a8")
    assert w8a8.layers[0].attn.quant_format == w8a8.layers[0].mlp.quant_format == "w8a8"
    assert w8.layers[0].attn.quant_format == "int8"
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


@pytest.mark.parametrize("fmt,dtype", [("w8a8", jnp.int8), ("fp8", jnp.float8_e4m3fn)])
def test_a_run_config_builds_its_quantized_generator(fmt, dtype):
    from jaxrl.config import GenerateConfig, RunConfig
    from jaxrl.rl.sync import build_generator

    cfg = tiny_model_config()
    run_cfg = RunConfig(model=cfg, generate=GenerateConfig(num_slots=4, max_len=32,
                                                           quantize=fmt))
    mesh = make_meshes(MeshConfig(trainer=(1, 1), generator=(1, 1))).generator
    params = nnx.to_pure_dict(nnx.state(create_model(cfg, seed=0)))
    engine = build_generator(run_cfg, cfg, mesh, params, seq_len=16, version=0, eos_id=0,
                             multi=False).engine
    model = nnx.merge(engine.graphdef, engine.params.state)
    assert model.layers[0].attn.q_proj[...].dtype == dtype
    assert model.layers[0].attn.quant_format == model.layers[0].mlp.quant_format == fmt
