"""Qwen3-MoE: the config's checks, the grouped-matmul experts against a per-expert loop, logits
parity with `transformers` on tiny random models, and save -> `transformers` load."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.config import ConfigError, LoraConfig, ModelConfig
from jaxrl.generate import JaxEngine, SamplingParams, sample
from jaxrl.models import create_model, load_pretrained, save_pretrained
from jaxrl.models.moe import grouped_swiglu, load_balancing_loss, route
from jaxrl.sharding import logical_sharding, make_mesh
from jaxrl.testing import make_hf_model

TOL = 1e-4  # f32 logits, max abs difference

MOE = dict(architecture="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
           moe_intermediate_size=16, num_layers=3)

# HF config overrides: several experts, top-2, with / without norm_topk_prob, dense layers
# interleaved by mlp_only_layers and by decoder_sparse_step
HF_CASES = {
    "topk2": dict(num_experts=4, num_hidden_layers=2),
    "topk2_norm_tied": dict(num_experts=6, norm_topk_prob=True, tie_word_embeddings=True,
                            num_hidden_layers=2),
    "mlp_only_layers": dict(num_experts=4, norm_topk_prob=True, num_hidden_layers=3,
                            mlp_only_layers=[1]),
    "sparse_step": dict(num_experts=8, num_hidden_layers=4, decoder_sparse_step=2),
}


def _padded_batch(vocab=96):
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, vocab, (3, 9))
    mask = np.array([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7])
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


def _hf_logits(hf_model, tokens, mask, positions):
    with torch.no_grad():
        out = hf_model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                       position_ids=torch.tensor(positions))
    return out.logits.numpy()


def _ours(model, tokens, mask, positions):
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))


def test_config_checks():
    cfg = ModelConfig(**MOE, mlp_only_layers=[1])
    assert [cfg.is_sparse_layer(i) for i in range(3)] == [True, False, True]
    assert cfg.mlp_only_layers == (1,)
    step2 = ModelConfig(**{**MOE, "num_layers": 4}, decoder_sparse_step=2)
    assert [step2.is_sparse_layer(i) for i in range(4)] == [False, True, False, True]
    assert cfg.num_params(active=True) < cfg.num_params()
    assert ModelConfig().num_params(active=True) == ModelConfig().num_params()
    for bad in (dict(experts_per_token=5), dict(experts_per_token=0), dict(num_experts=0),
                dict(mlp_only_layers=(3,)), dict(router_aux_loss_coef=-1.0),
                dict(moe_intermediate_size=0)):
        with pytest.raises(ConfigError):
            ModelConfig(**{**MOE, **bad})
    with pytest.raises(ConfigError, match="not added to the training loss"):
        ModelConfig(**MOE, router_aux_loss_coef=0.001)
    with pytest.raises(ConfigError, match="architecture"):
        ModelConfig(num_experts=4)
    # LoRA: attention targets work, MLP targets are refused with the way out in the message
    ModelConfig(**MOE, lora=LoraConfig(rank=4, targets=("q", "v")))
    with pytest.raises(ConfigError, match="targets=q,k,v,o"):
        ModelConfig(**MOE, lora=LoraConfig(rank=4))


def test_grouped_experts_equal_a_loop_over_experts():
    rng = np.random.RandomState(0)
    n, e, f, x, k = 11, 8, 6, 5, 2
    x_NE = jnp.asarray(rng.randn(n, e), jnp.float32)
    logits = jnp.asarray(rng.randn(n, x), jnp.float32)
    wg, wu = (jnp.asarray(rng.randn(x, e, f), jnp.float32) for _ in range(2))
    wd = jnp.asarray(rng.randn(x, f, e), jnp.float32)
    for norm in (False, True):
        weights, experts = route(logits, k, norm)
        out = grouped_swiglu(x_NE, weights, experts, wg, wu, wd)
        probs = np.asarray(jax.nn.softmax(logits))
        ref = np.zeros((n, e))
        for i in range(n):
            top = np.argsort(-probs[i])[:k]
            w = probs[i, top] / (probs[i, top].sum() if norm else 1.0)
            for j, ex in zip(top, w, strict=True):
                h = np.asarray(jax.nn.silu(x_NE[i] @ wg[j]) * (x_NE[i] @ wu[j]))
                ref[i] += ex * (h @ np.asarray(wd[j]))
        np.testing.assert_allclose(np.asarray(out), ref, atol=1e-4, rtol=1e-5)
    # a uniform router and load give the balanced value k (HF's normalisation)
    uniform = jnp.zeros((8, 4))
    assert float(load_balancing_loss(uniform, jnp.arange(16).reshape(8, 2) % 4)) == pytest.approx(2)


@pytest.mark.parametrize("case", sorted(HF_CASES))
def test_logits_match_transformers(case, tmp_path):
    hf = make_hf_model("qwen3_moe", tmp_path, **HF_CASES[case])
    cfg, model = load_pretrained(tmp_path)
    assert cfg.architecture == "qwen3_moe" and cfg.num_experts == HF_CASES[case]["num_experts"]
    tokens, mask, positions = _padded_batch()
    ref = _hf_logits(hf, tokens, mask, positions)
    out = _ours(model, tokens, mask, positions)
    valid = mask.astype(bool)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(out[valid], ref[valid], atol=TOL, rtol=0)


def test_save_then_transformers_load_gives_same_logits(tmp_path):
    make_hf_model("qwen3_moe", tmp_path / "src", seed=1, **HF_CASES["mlp_only_layers"])
    cfg, model = load_pretrained(tmp_path / "src")
    save_pretrained(model, cfg, tmp_path / "out")
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    assert type(back).__name__ == "Qwen3MoeForCausalLM"
    assert back.config.mlp_only_layers == [1] and back.config.norm_topk_prob
    tokens, mask, positions = _padded_batch()
    ref = _hf_logits(back, tokens, mask, positions)
    out = _ours(model, tokens, mask, positions)
    valid = mask.astype(bool)
    np.testing.assert_allclose(out[valid], ref[valid], atol=TOL, rtol=0)
    cfg2, _ = load_pretrained(tmp_path / "out")
    assert cfg2 == cfg


def test_replaying_the_models_own_routing_changes_nothing():
    cfg = ModelConfig(**MOE, mlp_only_layers=(1,))
    model = create_model(cfg)
    tokens = jnp.arange(12).reshape(2, 6)
    run = nnx.jit(lambda m, t, ex: m.hidden_routed(t, experts_LBTK=ex))
    h, routing = run(model, tokens, None)
    assert routing.experts_LBTK.shape == (2, 2, 6, 2)  # layers 0 and 2 are sparse
    h_replay, replayed = run(model, tokens, routing.experts_LBTK)
    np.testing.assert_array_equal(np.asarray(replayed.experts_LBTK),
                                  np.asarray(routing.experts_LBTK))
    np.testing.assert_allclose(np.asarray(h_replay), np.asarray(h), atol=1e-6)


def _loss_and_logits(model, tokens):
    logits = model(tokens)
    return jnp.mean(jax.nn.log_softmax(logits)[..., 0] * jnp.arange(logits.shape[1])[None]), logits


def test_expert_parallel_trainer_mesh_equals_unsharded():
    """4 expert shards over `fsdp` (with tp 2): the same logits and gradients as one device."""
    cfg = ModelConfig(**{**MOE, "num_layers": 1, "num_experts": 8})
    mesh = make_mesh((4, 2), "trainer", jax.devices())
    model = create_model(cfg, seed=3)
    sharded = create_model(cfg, mesh=mesh, role="trainer", seed=3)
    assert sharded.layers[0].mlp.gate_proj[...].sharding.spec == PartitionSpec("fsdp", None, "tp")
    assert sharded.layers[0].mlp.down_proj[...].sharding.spec == PartitionSpec("fsdp", "tp", None)
    tokens = jnp.asarray(np.random.RandomState(0).randint(0, cfg.vocab_size, (8, 12)))
    step = nnx.jit(nnx.value_and_grad(_loss_and_logits, has_aux=True))
    (_, want), grads = step(model, tokens)
    with jax.set_mesh(mesh):
        tokens_sharded = jax.device_put(tokens, logical_sharding(mesh, "trainer", ("batch", None)))
        (_, got), grads_sharded = step(sharded, tokens_sharded)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-5, rtol=0)
    flat, flat_sharded = nnx.to_flat_state(grads), dict(nnx.to_flat_state(grads_sharded))
    for path, g in flat:
        np.testing.assert_allclose(np.asarray(flat_sharded[path][...]), np.asarray(g[...]),
                                   atol=1e-5, rtol=0, err_msg=str(path))


def test_generator_mesh_greedy_equals_transformers(tmp_path):
    """Experts over `tp` (2 shards), slots over `dp`: greedy decoding token for token."""
    hf = make_hf_model("qwen3_moe", tmp_path, seed=2, **HF_CASES["mlp_only_layers"])
    _, model = load_pretrained(tmp_path)
    mesh = make_mesh((2, 2), "generator", jax.devices()[4:])
    engine = JaxEngine(model, num_slots=4, max_len=32, chunk_steps=4, mesh=mesh)
    prompts = [[5, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42]]
    got = sample(engine, prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, c in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                              max_new_tokens=8, do_sample=False, pad_token_id=0)
        assert c.tokens == out[0, len(prompt):].tolist(), f"prompt of length {len(prompt)}"


@pytest.mark.parametrize("experts", [4, 8])
def test_mixtral_logits_and_round_trip_match_transformers(experts, tmp_path):
    """Mixtral's router is Qwen3-MoE's with norm_topk_prob and every layer sparse; its tensors
    (`block_sparse_moe.experts.{j}.w1/w3/w2`) load, and save back as a Mixtral checkpoint."""
    hf = make_hf_model("mixtral", tmp_path / "src", num_local_experts=experts, intermediate_size=32)
    cfg, model = load_pretrained(tmp_path / "src")
    assert (cfg.architecture, cfg.num_experts, cfg.norm_topk_prob) == ("mixtral", experts, True)
    assert not cfg.qk_norm and cfg.expert_size == 32
    tokens, mask, positions = _padded_batch()
    valid = mask.astype(bool)
    ref = _hf_logits(hf, tokens, mask, positions)
    out = _ours(model, tokens, mask, positions)
    assert np.abs(ref).max() > 1.0
    np.testing.assert_allclose(out[valid], ref[valid], atol=TOL, rtol=0)
    save_pretrained(model, cfg, tmp_path / "out")
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    assert type(back).__name__ == "MixtralForCausalLM"
    assert back.config.num_local_experts == experts
    np.testing.assert_allclose(_hf_logits(back, tokens, mask, positions)[valid], ref[valid],
                               atol=TOL, rtol=0)
    assert load_pretrained(tmp_path / "out")[0] == cfg
