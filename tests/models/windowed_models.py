"""Tiny random `transformers` models with sliding-window layers (Gemma 2, Gemma 3, OLMo 3,
Mistral), built in-process, for the parity tests of tests/models/test_gemma.py and the
`--init` run of tests/models/test_hub.py."""

from __future__ import annotations

from pathlib import Path

WINDOW = 8  # sequences in the tests run to ~3x this

TINY = dict(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            max_position_embeddings=256, rms_norm_eps=1e-6, attn_implementation="eager",
            # no end-of-sequence token: greedy generation runs to its length in both
            bos_token_id=None, eos_token_id=None, pad_token_id=0)
CASES = {
    # alternating sliding / full layers (HF's default pattern), both soft-caps, a query scalar
    # other than head_dim
    "gemma2": dict(sliding_window=WINDOW, query_pre_attn_scalar=24, attn_logit_softcapping=5.0,
                   final_logit_softcapping=3.0, rope_theta=10000.0),
    # sliding layers with their own rope base, q/k norms, the layer pattern as layer_types
    "gemma3": dict(sliding_window=WINDOW, query_pre_attn_scalar=16,
                   layer_types=["sliding_attention", "sliding_attention", "full_attention",
                                "sliding_attention"],
                   rope_parameters={"full_attention": {"rope_type": "default",
                                                       "rope_theta": 10000.0},
                                    "sliding_attention": {"rope_type": "default",
                                                          "rope_theta": 100.0}}),
    "olmo3": dict(sliding_window=WINDOW),
    "mistral": dict(sliding_window=WINDOW, num_hidden_layers=2),
}


def make_windowed_hf(arch: str, path: str | Path | None = None, seed: int = 0, **overrides):
    """A tiny random `transformers` model of `arch` (a key of `CASES`), optionally saved.
    Weights drawn with std 0.2, norm weights around their identity (0 for Gemma's 1 + w)."""
    import torch
    import transformers

    classes = {"gemma2": (transformers.Gemma2Config, transformers.Gemma2ForCausalLM),
               "gemma3": (transformers.Gemma3TextConfig, transformers.Gemma3ForCausalLM),
               "olmo3": (transformers.Olmo3Config, transformers.Olmo3ForCausalLM),
               "mistral": (transformers.MistralConfig, transformers.MistralForCausalLM)}
    if arch not in classes:
        raise ValueError(f"unknown arch {arch!r}; valid: {sorted(classes)}")
    config_cls, model_cls = classes[arch]
    cfg = config_cls(**{**TINY, **CASES[arch], **overrides})
    torch.manual_seed(seed)
    model = model_cls(cfg).float().eval()
    identity = 0.0 if arch.startswith("gemma") else 1.0
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(identity + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    if path is not None:
        model.save_pretrained(str(path), safe_serialization=True)
    return model
