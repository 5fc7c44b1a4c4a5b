"""Hugging Face checkpoints: read and write local `config.json` + `*.safetensors` directories.

Supports `Gemma2ForCausalLM` and `Gemma3ForCausalLM` (text only; sandwich norms, soft-capping,
sliding and global layers: `jaxrl/models/hf_window.py`), `LlamaForCausalLM`, `MistralForCausalLM`
(a sliding window, masked), `Olmo2ForCausalLM` (post-norm layers), `Olmo3ForCausalLM` (OLMo 2's
layers, sliding and global), `Phi3ForCausalLM` (fused on disk: `jaxrl/models/hf_fused.py`),
`Qwen2ForCausalLM`, `Qwen3ForCausalLM`, and the mixtures of experts `Qwen3MoeForCausalLM` and
`MixtralForCausalLM` (their experts: `jaxrl/models/hf_moe.py`).
Tensors are read one at a time from memory-mapped safetensors files (bf16 included, via
ml_dtypes), converted to jaxrl's layout, and — when a mesh is given — placed straight onto
their shards. LoRA adapters travel in PEFT's format (`load_pretrained(..., adapter=DIR)`,
`save_adapter`: `jaxrl/models/peft_io.py`); the safetensors reader and writer are in
`jaxrl/models/safetensors_io.py`.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict
from jax.sharding import Mesh

from jaxrl.config import ConfigError, ModelConfig, RopeScaling
from jaxrl.config.sections import GEMMA_ARCHITECTURES
from jaxrl.dtypes import canonical_dtype
from jaxrl.models import hf_fused, hf_moe, hf_window, lora
from jaxrl.models.model import abstract_model
from jaxrl.models.peft_io import (
    adapter_map,
    read_adapter,
    save_adapter,  # noqa: F401  (re-exported: hf.save_adapter)
)
from jaxrl.models.safetensors_io import CheckpointError, read_safetensors, write_safetensors
from jaxrl.models.transformer import Transformer
from jaxrl.sharding import Role, state_shardings

ARCHITECTURES = {
    "Gemma2ForCausalLM": "gemma2",
    "Gemma3ForCausalLM": "gemma3",
    "LlamaForCausalLM": "llama",
    "MistralForCausalLM": "mistral",
    "MixtralForCausalLM": "mixtral",
    "Olmo2ForCausalLM": "olmo2",
    "Olmo3ForCausalLM": "olmo3",
    "Phi3ForCausalLM": "phi3",
    "Qwen2ForCausalLM": "qwen2",
    "Qwen3ForCausalLM": "qwen3",
    "Qwen3MoeForCausalLM": "qwen3_moe",
}
_MODEL_TYPES = {**{a: a for a in ARCHITECTURES.values()}, "gemma3": "gemma3_text"}  # HF's
_WINDOWED = ("gemma2", "gemma3", "mistral", "mixtral", "olmo3", "phi3")  # may carry a window
def _checkpoint_tensors(path: Path) -> dict[str, np.ndarray]:
    index = path / "model.safetensors.index.json"
    if index.exists():
        files = sorted(set(json.loads(index.read_text())["weight_map"].values()))
    else:
        files = sorted(p.name for p in path.glob("*.safetensors"))
    if not files:
        raise CheckpointError(f"{path}: no *.safetensors files (only safetensors are supported)")
    tensors = {}
    for name in files:
        tensors.update(read_safetensors(path / name))
    return tensors


# --------------------------------------------------------------------------- config mapping


def config_from_hf(hf: dict, **overrides) -> ModelConfig:
    """Translate a HF `config.json` dict into a ModelConfig."""
    archs = hf.get("architectures") or []
    arch = next((ARCHITECTURES[a] for a in archs if a in ARCHITECTURES), None)
    if arch is None:
        raise CheckpointError(
            f"unsupported architecture {archs!r}; supported: {sorted(ARCHITECTURES)}"
        )
    if hf.get("mlp_bias"):
        raise CheckpointError("mlp_bias=true is not supported")
    if hf.get("use_sliding_window"):
        raise CheckpointError("use_sliding_window=true is not supported")
    window_fields, rope = hf_window.config_fields(arch, hf, windowed=arch in _WINDOWED)
    rope_type = rope.get("rope_type", rope.get("type", "default"))
    scaling = None
    if rope_type == "llama3":
        scaling = RopeScaling(
            factor=float(rope["factor"]), low_freq_factor=float(rope["low_freq_factor"]),
            high_freq_factor=float(rope["high_freq_factor"]),
            original_max_position_embeddings=int(rope["original_max_position_embeddings"]),
        )
    elif rope_type == "linear":  # Gemma 3 4B+: positions divided by factor
        scaling = RopeScaling(rope_type="linear", factor=float(rope["factor"]))
    elif rope_type not in ("default", None):
        raise CheckpointError(f"unsupported rope_type {rope_type!r}; supported: default, "
                              "llama3, linear")
    heads = hf["num_attention_heads"]
    if arch == "phi3":
        partial = (hf.get("rope_parameters") or {}).get(
            "partial_rotary_factor", hf.get("partial_rotary_factor", 1.0))
        if float(partial) != 1.0:
            raise CheckpointError(f"partial_rotary_factor={partial} (rotary embedding on part "
                                  "of each head) is not supported; supported: 1.0")
    fields = dict(
        architecture=arch,
        vocab_size=hf["vocab_size"],
        hidden_size=hf["hidden_size"],
        intermediate_size=hf["intermediate_size"],
        num_layers=hf["num_hidden_layers"],
        num_heads=heads,
        num_kv_heads=hf.get("num_key_value_heads") or heads,
        head_dim=hf.get("head_dim") or hf["hidden_size"] // heads,
        rope_theta=float(rope["rope_theta"]),
        rope_scaling=scaling,
        rms_norm_eps=float(hf.get("rms_norm_eps", 1e-6)),
        max_position_embeddings=int(hf.get("max_position_embeddings", 2048)),
        tie_embeddings=bool(hf.get("tie_word_embeddings", False)),
        qkv_bias=arch == "qwen2" or bool(hf.get("attention_bias", False)),
        o_bias=arch == "llama" and bool(hf.get("attention_bias", False)),
        qk_norm=arch in ("qwen3", "qwen3_moe", "olmo2", "olmo3"),
        qk_norm_full=arch in ("olmo2", "olmo3"),
        post_norm=arch in ("olmo2", "olmo3"),
    )
    fields.update(window_fields)
    if arch == "qwen3_moe":
        fields.update(hf_moe.config_fields(hf))
    if arch == "mixtral":
        fields.update(hf_moe.mixtral_config_fields(hf))
    fields.update(overrides)
    return ModelConfig(**fields)


def config_to_hf(cfg: ModelConfig, dtype: Any = "float32") -> dict:
    """A HF `config.json` dict for `cfg`; `dtype` (any spelling `canonical_dtype` takes) is
    recorded as the checkpoint's `torch_dtype`."""
    dtype = canonical_dtype(dtype, "config_to_hf: dtype", ConfigError)
    arch = {v: k for k, v in ARCHITECTURES.items()}[cfg.architecture]
    out = {
        "architectures": [arch],
        "model_type": _MODEL_TYPES[cfg.architecture],
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_layers,
        "num_attention_heads": cfg.num_heads,
        "num_key_value_heads": cfg.num_kv_heads,
        "head_dim": cfg.head_size,
        "hidden_act": "silu",
        "rms_norm_eps": cfg.rms_norm_eps,
        "max_position_embeddings": cfg.max_position_embeddings,
        "tie_word_embeddings": cfg.tie_embeddings,
        "rope_theta": cfg.rope_theta,
        "torch_dtype": dtype,
        "use_cache": True,
    }
    if cfg.architecture == "llama":
        if cfg.qkv_bias != cfg.o_bias:
            raise CheckpointError("a Llama checkpoint needs qkv_bias == o_bias (attention_bias)")
        out["attention_bias"] = cfg.qkv_bias
        out["mlp_bias"] = False
    if cfg.architecture in GEMMA_ARCHITECTURES:
        out["hidden_act"] = "gelu_pytorch_tanh"
    if cfg.architecture in _WINDOWED:
        out.update(hf_window.config_to_hf(cfg))
    elif cfg.sliding_window is not None:
        raise CheckpointError(f"a {arch} checkpoint has no sliding window; sliding_window="
                              f"{cfg.sliding_window} needs one of {list(_WINDOWED)}")
    if cfg.architecture in ("mistral", "mixtral", "phi3"):
        if cfg.qkv_bias or cfg.o_bias or cfg.qk_norm:
            raise CheckpointError(f"a {arch} checkpoint has no attention biases or q/k norms")
        if cfg.architecture == "phi3":  # else Phi3Config's default (32000), maybe past the vocab
            out["pad_token_id"] = None
    if cfg.num_experts:
        out.update(hf_moe.config_to_hf(cfg))
    rs = cfg.rope_scaling
    if rs is not None and rs.rope_type == "linear":
        out["rope_scaling"] = {"rope_type": "linear", "factor": rs.factor}
    elif rs is not None:
        out["rope_scaling"] = {
            "rope_type": "llama3", "factor": rs.factor, "low_freq_factor": rs.low_freq_factor,
            "high_freq_factor": rs.high_freq_factor,
            "original_max_position_embeddings": rs.original_max_position_embeddings,
        }
    return out


# --------------------------------------------------------------------------- tensor mapping

Convert = Callable[[np.ndarray], np.ndarray]


def _tensor_map(cfg: ModelConfig) -> dict[tuple, tuple[str, Convert, Convert]]:
    """jaxrl parameter path -> (HF tensor name, HF->jaxrl conversion, jaxrl->HF conversion)."""
    h, k, d, e = cfg.num_heads, cfg.num_kv_heads, cfg.head_size, cfg.hidden_size
    same = (lambda x: x, lambda x: x)
    transpose = (lambda x: x.T, lambda x: x.T)

    def proj_in(n):  # HF [n*D, E] <-> jaxrl [E, n, D]
        return (lambda x: x.reshape(n, d, e).transpose(2, 0, 1),
                lambda x: x.transpose(1, 2, 0).reshape(n * d, e))

    def bias(n):  # HF [n*D] <-> jaxrl [n, D]
        return (lambda x: x.reshape(n, d), lambda x: x.reshape(n * d))

    proj_out = (lambda x: x.reshape(e, h, d).transpose(1, 2, 0),  # HF [E, H*D] <-> [H, D, E]
                lambda x: x.transpose(2, 0, 1).reshape(e, h * d))
    m = {("embed",): ("model.embed_tokens.weight", *same),
         ("final_norm", "weight"): ("model.norm.weight", *same)}
    if not cfg.tie_embeddings:
        m[("lm_head",)] = ("lm_head.weight", *transpose)
    for i in range(cfg.num_layers):
        p, a = f"model.layers.{i}.", ("layers", i)
        gemma = cfg.architecture in GEMMA_ARCHITECTURES  # sandwich norms
        if cfg.post_norm or gemma:  # OLMo 2 / 3, Gemma
            m[a + ("post_mlp_norm", "weight")] = (p + "post_feedforward_layernorm.weight", *same)
        if not cfg.post_norm:
            m[a + ("input_norm", "weight")] = (p + "input_layernorm.weight", *same)
        if gemma:
            m[a + ("pre_mlp_norm", "weight")] = (p + "pre_feedforward_layernorm.weight", *same)
        m[a + ("post_attn_norm", "weight")] = (p + "post_attention_layernorm.weight", *same)
        for name, n in (("q", h), ("k", k), ("v", k)):
            m[a + ("attn", f"{name}_proj")] = (p + f"self_attn.{name}_proj.weight", *proj_in(n))
            if cfg.qkv_bias:
                m[a + ("attn", f"{name}_bias")] = (p + f"self_attn.{name}_proj.bias", *bias(n))
        m[a + ("attn", "o_proj")] = (p + "self_attn.o_proj.weight", *proj_out)
        if cfg.o_bias:
            m[a + ("attn", "o_bias")] = (p + "self_attn.o_proj.bias", *same)
        if cfg.qk_norm:  # OLMo 2's over all heads: HF [n*D] <-> jaxrl [n, D]
            full = cfg.qk_norm_full
            m[a + ("attn", "q_norm", "weight")] = (p + "self_attn.q_norm.weight",
                                                   *(bias(h) if full else same))
            m[a + ("attn", "k_norm", "weight")] = (p + "self_attn.k_norm.weight",
                                                   *(bias(k) if full else same))
        if cfg.is_sparse_layer(i):
            m.update(hf_moe.layer_map(p, a))
            continue
        for name in ("gate", "up", "down"):
            m[a + ("mlp", f"{name}_proj")] = (p + f"mlp.{name}_proj.weight", *transpose)
    return m


# --------------------------------------------------------------------------- public API


def load_pretrained(
    path: str | Path,
    dtype: Any = None,
    *,
    mesh: Mesh | None = None,
    role: Role = "trainer",
    adapter: str | Path | None = None,
    **config_overrides,
) -> tuple[ModelConfig, Transformer]:
    """Load a local HF directory into `(config, model)`; with `mesh`, onto its shards directly.

    `dtype` sets both the parameter and compute dtype (default: float32), as a name or a numpy
    / JAX dtype: "bfloat16", `jnp.bfloat16`, `np.float32`, `jnp.dtype("float32")` all work.
    `adapter`: a PEFT LoRA adapter directory (`adapter_config.json` + `adapter_model.safetensors`)
    to load on top; the config's `lora` then comes from its adapter_config.json and the model
    holds the adapters (float32, as jaxrl trains them).
    """
    path = Path(path)
    if not (path / "config.json").is_file():
        raise CheckpointError(f"{path}: no config.json (expected a local Hugging Face directory)")
    if dtype is not None:
        dtype = canonical_dtype(dtype, "load_pretrained: dtype", ConfigError)
        config_overrides.setdefault("dtype", dtype)
        config_overrides.setdefault("param_dtype", dtype)
    tensors = _checkpoint_tensors(path)
    if adapter is not None:
        if "lora" in config_overrides:
            raise ConfigError("load_pretrained: pass adapter= or lora=, not both (an adapter's "
                              "LoraConfig comes from its adapter_config.json)")
        config_overrides["lora"], adapter_tensors = read_adapter(adapter)
    elif config_overrides.get("lora") is not None and config_overrides["lora"].enabled:
        raise ConfigError("load_pretrained: lora= without adapter= has no adapter weights to "
                          "load; load the base and let the trainer draw fresh adapters, or pass "
                          "a PEFT adapter directory as adapter=")
    cfg = config_from_hf(json.loads((path / "config.json").read_text()), **config_overrides)
    if cfg.num_experts:
        tensors = hf_moe.stack_experts(tensors, cfg)
    if cfg.architecture == "phi3":
        tensors = hf_fused.split_fused(tensors, cfg)
    graphdef, abstract = nnx.split(abstract_model(cfg))
    shardings = state_shardings(abstract, mesh, role) if mesh is not None else None
    flat_shardings = dict(shardings.flat_state()) if shardings is not None else {}
    tmap = _tensor_map(cfg)
    if adapter is not None:
        tmap.update(adapter_map(cfg))
        tensors.update(adapter_tensors)
    leaves = []
    for path_key, var in abstract.flat_state():
        if path_key not in tmap:
            raise CheckpointError(f"internal: no HF name for parameter {path_key}")
        name, to_ours, _ = tmap[path_key]
        want = tuple(var.get_value().shape)
        if name not in tensors:
            raise CheckpointError(f"{path}: missing tensor {name!r} (expected shape {want})")
        try:
            arr = to_ours(np.asarray(tensors[name]))
        except ValueError:
            arr = None
        if arr is None or tuple(arr.shape) != want:
            raise CheckpointError(
                f"{path}: tensor {name!r} has shape {tuple(tensors[name].shape)}, which does not "
                f"fit parameter {'/'.join(map(str, path_key))} of shape {want}"
            )
        arr = arr.astype(var.get_value().dtype)
        sharding = flat_shardings.get(path_key)
        value = jax.device_put(arr, sharding) if sharding is not None else jax.numpy.asarray(arr)
        leaves.append((path_key, var.replace(value)))
    used = {name for name, _, _ in tmap.values()}
    ignorable = {"lm_head.weight"} if cfg.tie_embeddings else set()
    unused = sorted(n for n in tensors if n not in used | ignorable and "rotary_emb" not in n)
    if unused:
        raise CheckpointError(
            f"{path}: {len(unused)} tensor(s) in the checkpoint have no place in a "
            f"{cfg.architecture} model with this config, e.g. {unused[:3]}"
        )
    state = nnx.State.from_flat_path(leaves)
    return cfg, nnx.merge(graphdef, state)


def save_pretrained(
    model: Transformer, cfg: ModelConfig, path: str | Path, dtype: Any = "float32", *,
    merge_adapters: bool = True,
) -> Path:
    """Write `config.json` + `model.safetensors` that `transformers` loads back, the tensors in
    `dtype` (any spelling `canonical_dtype` takes).

    A model with LoRA adapters is written merged (`W + s A B`, `jaxrl.models.lora.merge`) as a
    plain model; `merge_adapters=False` refuses it (`save_adapter` writes the adapters alone in
    PEFT's format)."""
    dtype = canonical_dtype(dtype, "save_pretrained: dtype", ConfigError)
    params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if lora.has_adapters(params):
        if not merge_adapters:
            raise CheckpointError(
                "save_pretrained(merge_adapters=False): the model holds LoRA adapters, which a "
                "plain Hugging Face checkpoint has no place for; write them with "
                "jaxrl.models.hf.save_adapter(model, DIR) (a PEFT adapter directory) and the "
                "base with save_pretrained of the model without adapters, or pass "
                "merge_adapters=True for one merged checkpoint")
        params = jax.jit(lora.merge, static_argnums=1)(params, cfg.lora)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    np_dtype = np.dtype(dtype)
    tmap = _tensor_map(cfg)
    tensors = {}
    for path_key, value in flatten_dict(params).items():
        name, _, to_hf = tmap[path_key]
        host = np.asarray(jax.device_get(value), dtype=np.float32)
        tensors[name] = to_hf(host).astype(np_dtype)
    tensors = hf_moe.unstack_experts(tensors, cfg)
    if cfg.architecture == "phi3":
        tensors = hf_fused.fuse(tensors)
    write_safetensors(path / "model.safetensors", tensors)
    (path / "config.json").write_text(json.dumps(config_to_hf(cfg, dtype), indent=2))
    return path
