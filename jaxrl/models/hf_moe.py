"""The mixture-of-experts part of Hugging Face checkpoint I/O, Qwen3-MoE and Mixtral
(`jaxrl/models/hf.py` does the rest).

On disk a Qwen3-MoE sparse layer holds the router `mlp.gate.weight` `[X, E]` and one
`mlp.experts.{j}.{gate,up,down}_proj.weight` per expert (what `transformers` writes, whatever
layout it uses in memory); Mixtral's are `block_sparse_moe.gate.weight` and
`block_sparse_moe.experts.{j}.{w1,w3,w2}.weight` (gate, up, down), renamed to the former on
loading and back on saving. jaxrl stacks the experts along a leading axis, so loading stacks the
X tensors of each projection into one (named `mlp.experts.{proj}`, a name only this module and
the tensor map use) and saving splits them again.
"""

from __future__ import annotations

import re

import numpy as np

from jaxrl.config import ModelConfig
from jaxrl.models.safetensors_io import CheckpointError

PROJECTIONS = ("gate_proj", "up_proj", "down_proj")
_EXPERT = re.compile(r"^(model\.layers\.\d+\.mlp\.experts)\.(\d+)\.(\w+_proj)\.weight$")


def config_fields(hf: dict) -> dict:
    """ModelConfig fields of a `Qwen3MoeConfig` dict."""
    experts = hf.get("num_experts", hf.get("num_local_experts"))
    if not experts:
        raise CheckpointError("a Qwen3MoeForCausalLM config without experts (num_experts 0) is "
                              "a dense Qwen3; convert it to Qwen3ForCausalLM")
    return dict(
        num_experts=int(experts),
        experts_per_token=int(hf.get("num_experts_per_tok", 8)),
        moe_intermediate_size=int(hf.get("moe_intermediate_size", 768)),
        norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
        decoder_sparse_step=int(hf.get("decoder_sparse_step", 1)),
        mlp_only_layers=tuple(int(i) for i in hf.get("mlp_only_layers") or ()),
        router_aux_loss_coef=0.0,  # off for RL whatever the checkpoint trained with
    )


def mixtral_config_fields(hf: dict) -> dict:
    """ModelConfig fields of a `MixtralConfig` dict: the top-k router renormalised over the
    chosen experts (`norm_topk_prob`), every layer sparse, experts of `intermediate_size`."""
    if not hf.get("num_local_experts"):
        raise CheckpointError("a MixtralForCausalLM config without num_local_experts")
    return dict(
        num_experts=int(hf["num_local_experts"]),
        experts_per_token=int(hf.get("num_experts_per_tok", 2)),
        moe_intermediate_size=int(hf["intermediate_size"]),
        norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=(),
        router_aux_loss_coef=0.0,  # off for RL whatever the checkpoint trained with
    )


def config_to_hf(cfg: ModelConfig) -> dict:
    if cfg.architecture == "mixtral":
        if not cfg.norm_topk_prob or cfg.mlp_only_layers or cfg.decoder_sparse_step != 1:
            raise CheckpointError("a Mixtral checkpoint has every layer sparse and "
                                  "norm_topk_prob=True")
        return {"num_local_experts": cfg.num_experts,
                "num_experts_per_tok": cfg.experts_per_token,
                "intermediate_size": cfg.expert_size,
                "router_aux_loss_coef": cfg.router_aux_loss_coef,
                "output_router_logits": False}
    return {
        "num_experts": cfg.num_experts,
        "num_experts_per_tok": cfg.experts_per_token,
        "moe_intermediate_size": cfg.expert_size,
        "norm_topk_prob": cfg.norm_topk_prob,
        "decoder_sparse_step": cfg.decoder_sparse_step,
        "mlp_only_layers": list(cfg.mlp_only_layers),
        "router_aux_loss_coef": cfg.router_aux_loss_coef,
        "attention_bias": cfg.qkv_bias,
        "use_sliding_window": False,
    }


def layer_map(prefix: str, path: tuple) -> dict:
    """Tensor-map entries of one sparse layer (see `hf._tensor_map`)."""
    swap = (lambda x: x.transpose(0, 2, 1), lambda x: x.transpose(0, 2, 1))
    m = {path + ("mlp", "router"): (prefix + "mlp.gate.weight", lambda x: x.T, lambda x: x.T)}
    for proj in PROJECTIONS:  # stacked HF [X, out, in] <-> jaxrl [X, in, out]
        m[path + ("mlp", proj)] = (prefix + f"mlp.experts.{proj}", *swap)
    return m


_MIXTRAL = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}
_MOE_TENSOR = re.compile(
    r"^(model\.layers\.\d+)\.(block_sparse_moe|mlp)\.(?:gate|experts\.(\d+)\.(\w+))\.weight$")


def _rename(tensors: dict, module: str, to_module: str, projections: dict) -> dict:
    """Each layer's router and expert tensors under `module` moved to `to_module`, the expert
    projections renamed by `projections`; every other tensor unchanged."""
    out = {}
    for name, t in tensors.items():
        m = _MOE_TENSOR.match(name)
        if m and m[2] == module and (m[3] is None or m[4] in projections):
            tail = "gate" if m[3] is None else f"experts.{m[3]}.{projections[m[4]]}"
            name = f"{m[1]}.{to_module}.{tail}.weight"
        out[name] = t
    return out


def from_mixtral(tensors: dict) -> dict:
    """Mixtral's tensor names as Qwen3-MoE's (the names the rest of this module uses)."""
    return _rename(tensors, "block_sparse_moe", "mlp", _MIXTRAL)


def to_mixtral(tensors: dict) -> dict:
    """The inverse of `from_mixtral`, for writing a Mixtral checkpoint."""
    return _rename(tensors, "mlp", "block_sparse_moe", {v: k for k, v in _MIXTRAL.items()})


def stack_experts(tensors: dict, cfg: ModelConfig) -> dict:
    """The checkpoint's tensors with each sparse layer's per-expert tensors stacked."""
    if cfg.architecture == "mixtral":
        tensors = from_mixtral(tensors)
    out = {n: t for n, t in tensors.items() if not _EXPERT.match(n)}
    used = set()
    for i in range(cfg.num_layers):
        if not cfg.is_sparse_layer(i):
            continue
        base = f"model.layers.{i}.mlp.experts"
        for proj in PROJECTIONS:
            names = [f"{base}.{j}.{proj}.weight" for j in range(cfg.num_experts)]
            missing = [n for n in names if n not in tensors]
            if missing:
                raise CheckpointError(f"missing expert tensor(s) {missing[:3]} of layer {i} "
                                      f"({cfg.num_experts} experts expected)")
            out[f"{base}.{proj}"] = np.stack([np.asarray(tensors[n]) for n in names])
            used.update(names)
    # experts the config has no place for stay, so that the loader reports them as unused
    out.update({n: t for n, t in tensors.items() if _EXPERT.match(n) and n not in used})
    return out


def unstack_experts(tensors: dict, cfg: ModelConfig) -> dict:
    """The inverse of `stack_experts`, for writing a checkpoint."""
    out = {}
    for name, t in tensors.items():
        base, _, proj = name.rpartition(".")
        if base.endswith(".mlp.experts") and proj in PROJECTIONS:
            for j in range(t.shape[0]):
                out[f"{base}.{j}.{proj}.weight"] = np.ascontiguousarray(t[j])
        else:
            out[name] = t
    return to_mixtral(out) if cfg.architecture == "mixtral" else out
