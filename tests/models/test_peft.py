"""LoRA adapters in and out of Hugging Face PEFT: logit parity both ways, merged export, and the
adapter configs jaxrl refuses. Tiny random `transformers` models; f32 logits within 1e-4."""

import dataclasses
import json
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.config import ConfigError, LoraConfig
from jaxrl.models import create_model, load_pretrained, save_pretrained
from jaxrl.models.hf import CheckpointError, save_adapter
from jaxrl.testing import make_hf_model

peft = pytest.importorskip("peft")
transformers = pytest.importorskip("transformers")

TOL = 1e-4  # f32 logits, max abs difference
ALL = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
CASES = {  # arch, transformers config overrides: tied and untied embeddings
    "llama": ("llama", {}),
    "llama_tied": ("llama", {"tie_word_embeddings": True}),
    "qwen2": ("qwen2", {}),
    "qwen3_tied": ("qwen3", {"tie_word_embeddings": True}),
}


def _batch():
    rng = np.random.RandomState(0)
    tokens = rng.randint(0, 96, (2, 9))
    mask = np.array([[1] * 9, [1] * 5 + [0] * 4])
    positions = np.maximum(np.cumsum(mask, 1) - 1, 0)
    return tokens, mask, positions


def _torch_logits(model, batch):
    tokens, mask, positions = batch
    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens), attention_mask=torch.tensor(mask),
                     position_ids=torch.tensor(positions)).logits.numpy()


def _ours(model, batch):
    tokens, mask, positions = batch
    return np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions), jnp.asarray(mask)))


def _close(a, b, batch):
    valid = batch[1].astype(bool)
    np.testing.assert_allclose(a[valid], b[valid], atol=TOL, rtol=0)


def _peft_adapter(hf, out, seed=0, **lora_kw):
    """Wrap `hf` in a PEFT LoRA with random non-zero A and B, save it to `out`; the PeftModel."""
    kw = dict(r=4, lora_alpha=8, target_modules=ALL, init_lora_weights=False)
    pm = peft.get_peft_model(hf, peft.LoraConfig(**{**kw, **lora_kw}))
    torch.manual_seed(seed)
    with torch.no_grad():
        for name, p in pm.named_parameters():
            if "lora_" in name:
                p.copy_(0.3 * torch.randn_like(p))
    pm.save_pretrained(str(out))
    return pm.eval()


def _jaxrl_with_adapters(base_dir, lora_cfg, seed=0):
    """The base at `base_dir` with random non-zero adapters (B too) of `lora_cfg`."""
    cfg, base = load_pretrained(base_dir, "float32")
    cfg = dataclasses.replace(cfg, lora=lora_cfg)
    model = create_model(cfg)
    params = nnx.to_pure_dict(nnx.state(model))
    keys = iter(jax.random.split(jax.random.key(seed), 1000))

    def fill(tree, base_tree):
        for k, v in tree.items():
            if isinstance(v, dict):
                fill(v, base_tree.get(k, {}))
            elif k in base_tree:
                tree[k] = base_tree[k]
            else:
                tree[k] = 0.3 * jax.random.normal(next(keys), v.shape, v.dtype)

    fill(params, nnx.to_pure_dict(nnx.state(base)))
    state = nnx.state(model)
    nnx.replace_by_pure_dict(state, params)
    nnx.update(model, state)
    return cfg, model


@pytest.mark.parametrize("case", sorted(CASES))
def test_peft_adapter_loads_with_equal_logits(case, tmp_path):
    arch, kw = CASES[case]
    hf = make_hf_model(arch, tmp_path / "base", **kw)
    batch = _batch()
    plain = _torch_logits(hf, batch)
    pm = _peft_adapter(hf, tmp_path / "adapter")
    ref = _torch_logits(pm, batch)
    assert np.abs(ref - plain).max() > 1.0  # the adapters matter
    cfg, model = load_pretrained(tmp_path / "base", "float32", adapter=tmp_path / "adapter")
    assert cfg.lora == LoraConfig(rank=4, alpha=8.0, targets=("q", "k", "v", "o", "gate", "up",
                                                              "down"), rslora=False)
    assert model.layers[0].attn.q_lora_b[...].dtype == jnp.float32
    _close(_ours(model, batch), ref, batch)


@pytest.mark.parametrize("case", sorted(CASES))
def test_save_adapter_loads_in_peft_and_merged_in_transformers(case, tmp_path):
    arch, kw = CASES[case]
    hf = make_hf_model(arch, tmp_path / "base", seed=1, **kw)
    batch = _batch()
    plain = _torch_logits(hf, batch)
    cfg, model = _jaxrl_with_adapters(tmp_path / "base", LoraConfig(rank=4, alpha=8.0))
    ours = _ours(model, batch)
    assert np.abs(ours - plain).max() > 1.0
    save_adapter(model, tmp_path / "adapter", base_model_name_or_path="tiny-base")
    assert json.loads((tmp_path / "adapter/adapter_config.json").read_text())[
        "base_model_name_or_path"] == "tiny-base"
    pm = peft.PeftModel.from_pretrained(hf, str(tmp_path / "adapter")).eval()
    _close(ours, _torch_logits(pm, batch), batch)
    # the pure-dict form (what a LoRA run's train state holds: the adapters alone) writes the same
    from jaxrl.models import lora

    adapters = lora.split(nnx.to_pure_dict(nnx.state(model)))[1]
    save_adapter(adapters, tmp_path / "adapter2", cfg)
    weights = "adapter_model.safetensors"
    assert (tmp_path / "adapter2" / weights).read_bytes() == (tmp_path / "adapter" / weights
                                                              ).read_bytes()
    # merged: a plain checkpoint transformers loads
    save_pretrained(model, cfg, tmp_path / "merged")
    back = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path / "merged")).eval()
    _close(ours, _torch_logits(back.float(), batch), batch)
    with pytest.raises(CheckpointError, match="save_adapter"):
        save_pretrained(model, cfg, tmp_path / "refused", merge_adapters=False)


def test_rslora_and_a_subset_of_targets_both_ways(tmp_path):
    hf = make_hf_model("qwen2", tmp_path / "base", seed=2)
    batch = _batch()
    pm = _peft_adapter(hf, tmp_path / "adapter", r=8, lora_alpha=4, use_rslora=True,
                       target_modules=["q_proj", "v_proj", "down_proj"])
    cfg, model = load_pretrained(tmp_path / "base", adapter=tmp_path / "adapter")
    assert cfg.lora == LoraConfig(rank=8, alpha=4.0, targets=("q", "v", "down"), rslora=True)
    assert not hasattr(model.layers[0].attn, "k_lora_a")
    _close(_ours(model, batch), _torch_logits(pm, batch), batch)
    # and back out: jaxrl -> PEFT with rsLoRA on k/o/up
    base = make_hf_model("qwen2", None, seed=2)
    lora_cfg = LoraConfig(rank=2, alpha=3.0, targets=("k", "o", "up"), rslora=True)
    _, model = _jaxrl_with_adapters(tmp_path / "base", lora_cfg, seed=3)
    save_adapter(model, tmp_path / "out")
    raw = json.loads((tmp_path / "out/adapter_config.json").read_text())
    assert raw["use_rslora"] and raw["target_modules"] == ["k_proj", "o_proj", "up_proj"]
    pm = peft.PeftModel.from_pretrained(base, str(tmp_path / "out")).eval()
    _close(_ours(model, batch), _torch_logits(pm, batch), batch)


UNSUPPORTED = {  # adapter_config.json edit -> the key the error names
    "dora": ({"use_dora": True}, "use_dora"),
    "bias": ({"bias": "lora_only"}, "bias"),
    "fan_in_fan_out": ({"fan_in_fan_out": True}, "fan_in_fan_out"),
    "embed": ({"target_modules": ["q_proj", "embed_tokens"]}, "target_modules"),
    "lm_head": ({"target_modules": ["lm_head"]}, "target_modules"),
    "regex": ({"target_modules": r".*\.q_proj"}, "target_modules"),
    "rank_pattern": ({"rank_pattern": {"q_proj": 8}}, "rank_pattern"),
    "alpha_pattern": ({"alpha_pattern": {"down_proj": 2}}, "alpha_pattern"),
    "modules_to_save": ({"modules_to_save": ["lm_head"]}, "modules_to_save"),
    "layers": ({"layers_to_transform": [0]}, "layers_to_transform"),
    "not_lora": ({"peft_type": "IA3"}, "peft_type"),
}


def test_unsupported_adapter_configs_name_the_file_and_valid_values(tmp_path):
    hf = make_hf_model("llama", tmp_path / "base")
    _peft_adapter(hf, tmp_path / "adapter")
    raw = json.loads((tmp_path / "adapter/adapter_config.json").read_text())
    for case, (edit, key) in UNSUPPORTED.items():
        bad = tmp_path / case
        shutil.copytree(tmp_path / "adapter", bad)
        (bad / "adapter_config.json").write_text(json.dumps({**raw, **edit}))
        with pytest.raises(CheckpointError, match=f"adapter_config.json: {key}=.*valid") as e:
            load_pretrained(tmp_path / "base", adapter=bad)
        assert str(bad) in str(e.value), case
    # a pattern equal to the global value is harmless
    same = tmp_path / "same_pattern"
    shutil.copytree(tmp_path / "adapter", same)
    (same / "adapter_config.json").write_text(json.dumps({**raw, "rank_pattern": {"q_proj": 4}}))
    assert load_pretrained(tmp_path / "base", adapter=same)[0].lora.rank == 4
    # a missing weights file, a missing directory, and lora= beside adapter=
    (same / "adapter_model.safetensors").unlink()
    with pytest.raises(CheckpointError, match="no adapter_model.safetensors"):
        load_pretrained(tmp_path / "base", adapter=same)
    with pytest.raises(CheckpointError, match="no adapter_config.json"):
        load_pretrained(tmp_path / "base", adapter=tmp_path / "nowhere")
    with pytest.raises(ConfigError, match="not both"):
        load_pretrained(tmp_path / "base", adapter=tmp_path / "adapter", lora=LoraConfig(rank=4))
