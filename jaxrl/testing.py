"""Fixtures for tests and examples: the tiny model config, tiny Hugging Face models.

Production code never imports this module (tests/test_production_imports.py checks): the named model shapes
live in `jaxrl.presets`, re-exported here for the tests.
"""

from __future__ import annotations

from pathlib import Path

from jaxrl.presets import tiny_model_config

__all__ = ["TINY_HF_KW", "make_hf_model", "tiny_model_config"]

TINY_HF_KW = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=10000.0,
)


def make_hf_model(arch: str, path: str | Path | None = None, seed: int = 0, **overrides):
    """A tiny random `transformers` model of `arch` (llama | qwen2 | qwen3), optionally saved.

    Weights are drawn with std 0.2 (not HF's 0.02) so logits vary enough for parity to mean much.
    """
    import torch
    import transformers

    kw = dict(TINY_HF_KW, **overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 16)
        cfg = transformers.Qwen3Config(**kw)
        cls = transformers.Qwen3ForCausalLM
    else:
        raise ValueError(f"unknown arch {arch!r}; valid: ['llama', 'qwen2', 'qwen3']")
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    if path is not None:
        model.save_pretrained(str(path), safe_serialization=True)
    return model
