"""Checkpoints whose projections are fused on disk: Phi-3 (`Phi3ForCausalLM`, also Phi-4).

Its attention holds one `self_attn.qkv_proj.weight` `[(H + 2K) * D, E]` (q, k, v rows in that
order) and its MLP one `mlp.gate_up_proj.weight` `[2 * I, E]` (gate rows, then up rows).
Loading splits them into the Llama names the tensor map knows (`hf._tensor_map`); saving fuses
them again. The model itself is Llama's (jaxrl fuses projections for speed where it measures
faster, `generate.fuse_projections`, independently of the checkpoint's layout).
"""

from __future__ import annotations

import re

import numpy as np

from jaxrl.config import ModelConfig

_QKV = re.compile(r"^(model\.layers\.\d+)\.self_attn\.qkv_proj\.weight$")
_GATE_UP = re.compile(r"^(model\.layers\.\d+)\.mlp\.gate_up_proj\.weight$")
_SPLIT = re.compile(
    r"^(model\.layers\.\d+)\.(self_attn\.[qkv]_proj|mlp\.(?:gate|up)_proj)\.weight$")


def split_fused(tensors: dict, cfg: ModelConfig) -> dict:
    """Phi-3's fused tensors as separate q/k/v and gate/up ones (others unchanged)."""
    q, kv = cfg.num_heads * cfg.head_size, cfg.num_kv_heads * cfg.head_size
    out = {}
    for name, t in tensors.items():
        if m := _QKV.match(name):
            t = np.asarray(t)
            if t.shape[0] == q + 2 * kv:  # else left whole, for the loader to report
                for proj, rows in (("q", t[:q]), ("k", t[q:q + kv]), ("v", t[q + kv:])):
                    out[f"{m[1]}.self_attn.{proj}_proj.weight"] = rows
                continue
        elif m := _GATE_UP.match(name):
            t = np.asarray(t)
            if t.shape[0] % 2 == 0:
                half = t.shape[0] // 2
                out[f"{m[1]}.mlp.gate_proj.weight"] = t[:half]
                out[f"{m[1]}.mlp.up_proj.weight"] = t[half:]
                continue
        out[name] = t
    return out


def fuse(tensors: dict) -> dict:
    """The inverse of `split_fused`, for writing a Phi-3 checkpoint."""
    out, parts = {}, {}
    for name, t in tensors.items():
        if m := _SPLIT.match(name):
            parts.setdefault(m[1], {})[m[2]] = t
        else:
            out[name] = t
    for layer, p in parts.items():
        out[f"{layer}.self_attn.qkv_proj.weight"] = np.concatenate(
            [p["self_attn.q_proj"], p["self_attn.k_proj"], p["self_attn.v_proj"]])
        out[f"{layer}.mlp.gate_up_proj.weight"] = np.concatenate(
            [p["mlp.gate_proj"], p["mlp.up_proj"]])
    return out
