"""Logits parity with Hugging Face `transformers` on tiny random models, and checkpoint I/O."""

import json

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from jaxrl.config import MeshConfig
from jaxrl.models import KVCache, create_model, load_pretrained, save_pretrained
from jaxrl.models.hf import CheckpointError, read_safetensors, write_safetensors
from jaxrl.sharding import make_meshes
from jaxrl.testing import make_hf_model, tiny_model_config

TOL = 1e-4  # f32 logits, max abs difference


def _padded_batch(vocab=96):
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, vocab, (3, 9))
    mask = np.array([[1] * 9, [1] * 5 + [0] * 4, [1] * 2 + [0] * 7])
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


def _hf_logits(hf_model, tokens, mask, positions):
    with torch.no_grad():
        out = hf_model(
            input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
            position_ids=torch.tensor(positions),
        )
    return out.logits.numpy()


def _ours(model, tokens, mask, positions):
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))


ARCH_CASES = {
    "llama": dict(),
    "llama_rope3_tied_bias": dict(
        tie_word_embeddings=True, attention_bias=True,
        rope_scaling={"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                      "high_freq_factor": 4.0, "original_max_position_embeddings": 16},
    ),
    "mistral": dict(),
    # windows shorter than the sequences (9) run past them: tests/models/test_gemma.py
    "mistral_window": dict(sliding_window=4),
    "olmo2": dict(),  # post-norm layers, q/k norms over all heads
    "olmo2_tied": dict(tie_word_embeddings=True, num_key_value_heads=4),
    "phi3": dict(),  # fused qkv_proj and gate_up_proj on disk
    "phi3_window_tied": dict(sliding_window=4, tie_word_embeddings=True),
    "qwen2": dict(),
    "qwen3": dict(tie_word_embeddings=True),
}


@pytest.mark.parametrize("case", sorted(ARCH_CASES))
def test_logits_match_transformers_on_padded_batch(case, tmp_path):
    arch = case.split("_")[0]
    hf = make_hf_model(arch, tmp_path, **ARCH_CASES[case])
    cfg, model = load_pretrained(tmp_path)
    assert cfg.architecture == arch
    assert cfg.sliding_window == ARCH_CASES[case].get("sliding_window")
    assert cfg.max_position_embeddings == hf.config.max_position_embeddings  # not the window
    tokens, mask, positions = _padded_batch()
    ref = _hf_logits(hf, tokens, mask, positions)
    out = _ours(model, tokens, mask, positions)
    valid = mask.astype(bool)
    assert np.abs(ref).max() > 1.0  # the comparison is not between near-zero logits
    np.testing.assert_allclose(out[valid], ref[valid], atol=TOL, rtol=0)


@pytest.mark.parametrize("arch", ["llama", "mistral", "olmo2", "phi3", "qwen2", "qwen3"])
def test_save_then_transformers_load_gives_same_logits(arch, tmp_path):
    make_hf_model(arch, tmp_path / "src", seed=1)
    cfg, model = load_pretrained(tmp_path / "src")
    save_pretrained(model, cfg, tmp_path / "out")
    import transformers

    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "out")).float().eval()
    tokens, mask, positions = _padded_batch()
    ref = _hf_logits(back, tokens, mask, positions)
    out = _ours(model, tokens, mask, positions)
    valid = mask.astype(bool)
    np.testing.assert_allclose(out[valid], ref[valid], atol=TOL, rtol=0)


def test_load_onto_trainer_and_generator_meshes_matches_unsharded(tmp_path):
    make_hf_model("qwen2", tmp_path)
    _, plain = load_pretrained(tmp_path)
    meshes = make_meshes(MeshConfig(trainer=(2, 2), generator=(2, 2)))
    tokens, mask, positions = _padded_batch()
    ref = _ours(plain, tokens, mask, positions)
    for role, mesh in (("trainer", meshes.trainer), ("generator", meshes.generator)):
        _, model = load_pretrained(tmp_path, mesh=mesh, role=role)
        q = model.layers[0].attn.q_proj[...]
        assert q.sharding.mesh == mesh and "tp" in q.sharding.spec  # really sharded
        np.testing.assert_allclose(_ours(model, tokens, mask, positions), ref, atol=TOL, rtol=0)


def test_sharded_init_equals_unsharded_init():
    cfg = tiny_model_config()
    mesh = make_meshes(MeshConfig(trainer=(4, 2), colocated=True)).trainer
    sharded = create_model(cfg, mesh=mesh, role="trainer", seed=3)
    plain = create_model(cfg, seed=3)
    assert sharded.embed[...].sharding.spec[1] == "fsdp"
    np.testing.assert_array_equal(np.asarray(sharded.embed[...]), np.asarray(plain.embed[...]))


@pytest.mark.parametrize("heads_major", [True, False])
def test_kv_cache_decode_matches_full_forward(heads_major):
    cfg = tiny_model_config(qk_norm=True)
    model = create_model(cfg, seed=0)
    tokens = jnp.asarray(np.random.RandomState(1).randint(0, cfg.vocab_size, (2, 10)))
    full = np.asarray(model(tokens))
    cache = KVCache.init(cfg, batch=2, max_len=16, heads_major=heads_major)
    assert cache.max_len == 16 and cache.heads_major == heads_major
    # prefill 6 tokens (row 1 only 4 valid, then padding that later writes overwrite)
    _, cache = model.decode(tokens[:, :6], cache, num_valid_B=jnp.array([6, 4]))
    assert cache.lengths_B.tolist() == [6, 4]
    step_logits = []
    for i in range(3):
        cols = jnp.stack([tokens[0, 6 + i], tokens[1, 4 + i]])[:, None]
        logits, cache = model.decode(cols, cache)
        step_logits.append(np.asarray(logits[:, 0]))
    for i in range(3):
        np.testing.assert_allclose(step_logits[i][0], full[0, 6 + i], atol=TOL, rtol=0)
        # row 1 saw tokens[1, :4] then tokens[1, 4 + i]: the same prefix as the full forward
        np.testing.assert_allclose(step_logits[i][1], full[1, 4 + i], atol=TOL, rtol=0)


def test_bf16_load(tmp_path):
    make_hf_model("llama", tmp_path)
    cfg, model = load_pretrained(tmp_path, dtype="bfloat16")
    assert model.embed[...].dtype == jnp.bfloat16 and cfg.dtype == "bfloat16"
    tokens, mask, positions = _padded_batch()
    _, ref_model = load_pretrained(tmp_path)
    out, ref = _ours(model, tokens, mask, positions), _ours(ref_model, tokens, mask, positions)
    assert np.abs(out - ref).max() < 0.1 * np.abs(ref).max()


def test_safetensors_roundtrip_bf16(tmp_path):
    import ml_dtypes

    x = np.arange(12, dtype=np.float32).reshape(3, 4).astype(ml_dtypes.bfloat16)
    write_safetensors(tmp_path / "a.safetensors", {"x": x, "y": np.ones(2, np.int32)})
    back = read_safetensors(tmp_path / "a.safetensors")
    np.testing.assert_array_equal(back["x"], x)
    from safetensors.numpy import load_file  # the reference reader agrees on int data

    assert load_file(str(tmp_path / "a.safetensors"))["y"].tolist() == [1, 1]


def test_unsupported_architecture_and_bad_tensors(tmp_path):
    make_hf_model("llama", tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    bad = dict(conf, architectures=["GPT2LMHeadModel"])
    (tmp_path / "config.json").write_text(json.dumps(bad))
    with pytest.raises(CheckpointError, match="unsupported architecture.*LlamaForCausalLM"):
        load_pretrained(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps(dict(conf, intermediate_size=64)))
    with pytest.raises(CheckpointError) as e:
        load_pretrained(tmp_path)
    assert "mlp." in str(e.value) and "(64, 128)" in str(e.value)
    tensors = dict(read_safetensors(tmp_path / "model.safetensors"))
    del tensors["model.norm.weight"]
    write_safetensors(tmp_path / "model.safetensors", {k: np.array(v) for k, v in tensors.items()})
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match="missing tensor 'model.norm.weight'"):
        load_pretrained(tmp_path)
    tensors["model.extra.weight"] = np.ones(3, np.float32)
    tensors["model.norm.weight"] = np.ones(64, np.float32)
    write_safetensors(tmp_path / "model.safetensors", {k: np.array(v) for k, v in tensors.items()})
    with pytest.raises(CheckpointError, match="no place.*model.extra.weight"):
        load_pretrained(tmp_path)
    with pytest.raises(CheckpointError, match="no config.json"):
        load_pretrained(tmp_path / "nowhere")


def test_jit_of_forward_matches_eager():
    model = create_model(tiny_model_config(), seed=0)
    tokens = jnp.ones((2, 5), jnp.int32)
    from flax import nnx

    jitted = nnx.jit(lambda m, t: m(t))
    np.testing.assert_allclose(np.asarray(jitted(model, tokens)), np.asarray(model(tokens)),
                               atol=1e-5)
    assert jax.devices()[0].platform == "cpu"


def test_phi3_partial_rotary_is_refused_by_name(tmp_path):
    make_hf_model("phi3", tmp_path)
    conf = json.loads((tmp_path / "config.json").read_text())
    conf.setdefault("rope_parameters", {})["partial_rotary_factor"] = 0.75  # Phi-4-mini's
    (tmp_path / "config.json").write_text(json.dumps(conf))
    with pytest.raises(CheckpointError, match="partial_rotary_factor=0.75 .*supported: 1.0"):
        load_pretrained(tmp_path)


def test_phi3_lora_adapters_are_refused_as_peft_and_export_merged(tmp_path):
    """PEFT adapters of Phi-3 sit on its fused modules, which jaxrl's per-projection adapters do
    not map onto: writing (or reading) one is a clear error, and the merged export still works."""
    from jaxrl.config import LoraConfig, ModelConfig
    from jaxrl.models.hf import save_adapter

    cfg = ModelConfig(architecture="phi3", vocab_size=96, lora=LoraConfig(rank=2))
    model = create_model(cfg)
    with pytest.raises(CheckpointError, match="fused qkv_proj / gate_up_proj.*--merge"):
        save_adapter(model, tmp_path / "adapter")
    assert not (tmp_path / "adapter").exists()
    save_pretrained(model, cfg, tmp_path / "merged")  # LoRA merged into the fused tensors
    names = set(read_safetensors(tmp_path / "merged" / "model.safetensors"))
    assert "model.layers.0.self_attn.qkv_proj.weight" in names
    assert "model.layers.0.mlp.gate_up_proj.weight" in names
    assert not any("q_proj" in n or "lora" in n for n in names)


@pytest.mark.parametrize("arch", ["olmo2", "phi3", "mistral"])
def test_greedy_generation_equals_transformers(arch, tmp_path):
    """The engine's cached decode (prefill, then one token at a time) of the newer families,
    token for token against `transformers.generate`."""
    from jaxrl.generate import JaxEngine, SamplingParams, sample

    hf = make_hf_model(arch, tmp_path, seed=3)
    _, model = load_pretrained(tmp_path)
    engine = JaxEngine(model, num_slots=2, max_len=32, chunk_steps=4)
    prompts = [[5, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    got = sample(engine, prompts, SamplingParams(max_tokens=8, temperature=0.0))
    for prompt, c in zip(prompts, got, strict=True):
        with torch.no_grad():
            out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                              max_new_tokens=8, min_new_tokens=8, do_sample=False,
                              pad_token_id=0)
        assert c.tokens == out[0, len(prompt):].tolist(), f"prompt of length {len(prompt)}"
