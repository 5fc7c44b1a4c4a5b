"""LoRA adapters in and out of Hugging Face PEFT's directory format.

A PEFT LoRA adapter directory holds `adapter_config.json` (`peft_type: LORA`, `r`, `lora_alpha`,
`target_modules`, `use_rslora`, ...) and `adapter_model.safetensors` with, per targeted
`nn.Linear` (weight `[out, in]`), `lora_A.weight` `[r, in]` and `lora_B.weight` `[out, r]`:

    base_model.model.model.layers.{i}.self_attn.q_proj.lora_A.weight

jaxrl keeps `A: [in..., r]` and `B: [r, out...]` beside the projection (`jaxrl.models.lora`), so
a PEFT tensor is the transpose of jaxrl's with the head axes folded, the way `hf._tensor_map`
folds the projections themselves. `read_adapter` turns a directory into a `LoraConfig` and the
PEFT tensors keyed by their names, plus the map from jaxrl's parameter paths to those names (used
by `hf.load_pretrained(..., adapter=DIR)`); `save_adapter` writes one that
`peft.PeftModel.from_pretrained(base, DIR)` loads. Only what jaxrl's model computes is accepted:
plain LoRA on the seven projections, the same rank and alpha everywhere, no bias, no DoRA.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from flax.traverse_util import flatten_dict

from jaxrl.config import LORA_TARGETS, ConfigError, LoraConfig, ModelConfig
from jaxrl.models import lora
from jaxrl.models.safetensors_io import CheckpointError, read_safetensors, write_safetensors

CONFIG_FILE = "adapter_config.json"
WEIGHTS_FILE = "adapter_model.safetensors"
PREFIX = "base_model.model."  # PeftModel -> the CausalLM it wraps
# jaxrl target -> the HF module it adapts, relative to model.layers.{i}
MODULES = {"q": "self_attn.q_proj", "k": "self_attn.k_proj", "v": "self_attn.v_proj",
           "o": "self_attn.o_proj", "gate": "mlp.gate_proj", "up": "mlp.up_proj",
           "down": "mlp.down_proj"}
_BY_HF_NAME = {m.rsplit(".", 1)[1]: t for t, m in MODULES.items()}  # "q_proj" -> "q"

Convert = Callable[[np.ndarray], np.ndarray]


def adapter_map(cfg: ModelConfig) -> dict[tuple, tuple[str, Convert, Convert]]:
    """jaxrl adapter path -> (PEFT tensor name, PEFT->jaxrl, jaxrl->PEFT) for `cfg.lora`'s
    targets. PEFT's A is `[r, in]` and B `[out, r]`; jaxrl's `[in..., r]` and `[r, out...]`."""
    if cfg.architecture == "phi3":
        raise CheckpointError(
            "a PEFT adapter of Phi-3 targets its fused qkv_proj / gate_up_proj modules, which "
            "jaxrl's per-projection adapters (q, k, v, gate, up) do not map onto; train with "
            "LoRA and export the merged model (launch/export.py --merge)")
    h, k, d = cfg.num_heads, cfg.num_kv_heads, cfg.head_size
    r = cfg.lora.rank
    t = (lambda x: x.T, lambda x: x.T)

    def heads_out(n):  # PEFT B [n*D, r] <-> jaxrl [r, n, D]
        return (lambda x: x.T.reshape(r, n, d), lambda x: x.reshape(r, n * d).T)

    heads_in = (lambda x: x.T.reshape(h, d, r),  # PEFT A [r, H*D] <-> jaxrl [H, D, r]
                lambda x: x.reshape(h * d, r).T)
    layouts = {"q": (t, heads_out(h)), "k": (t, heads_out(k)), "v": (t, heads_out(k)),
               "o": (heads_in, t), "gate": (t, t), "up": (t, t), "down": (t, t)}
    m = {}
    for i in range(cfg.num_layers):
        for target in cfg.lora.targets:
            where = ("layers", i, "mlp" if target in ("gate", "up", "down") else "attn")
            name = f"{PREFIX}model.layers.{i}.{MODULES[target]}"
            a, b = layouts[target]
            m[where + (f"{target}_lora_a",)] = (f"{name}.lora_A.weight", *a)
            m[where + (f"{target}_lora_b",)] = (f"{name}.lora_B.weight", *b)
    return m


# --------------------------------------------------------------------------- reading


def _bad(path: Path, key: str, got, valid: str) -> CheckpointError:
    return CheckpointError(f"{path / CONFIG_FILE}: {key}={got!r} is not supported; valid: {valid}")


def lora_config_from_peft(raw: dict, path: Path) -> LoraConfig:
    """The `LoraConfig` of a PEFT `adapter_config.json` dict, or a CheckpointError naming the
    file, the key and the values jaxrl can load."""
    if raw.get("peft_type") != "LORA":
        raise _bad(path, "peft_type", raw.get("peft_type"), "'LORA'")
    for key, valid in (("use_dora", False), ("fan_in_fan_out", False), ("lora_bias", False),
                       ("use_qalora", False)):
        if raw.get(key, valid) not in (valid, None):
            raise _bad(path, key, raw[key], f"{valid} (plain LoRA)")
    if raw.get("bias", "none") != "none":
        raise _bad(path, "bias", raw["bias"], "'none' (jaxrl adapters have no bias)")
    for key in ("modules_to_save", "layers_to_transform", "layers_pattern", "layer_replication",
                "trainable_token_indices", "target_parameters", "exclude_modules"):
        if raw.get(key):
            raise _bad(path, key, raw[key], "null (adapters on every layer's projections only)")
    r, alpha = raw.get("r"), raw.get("lora_alpha")
    if not isinstance(r, int) or r <= 0:
        raise _bad(path, "r", r, "an integer > 0")
    if not isinstance(alpha, (int, float)) or alpha <= 0:
        raise _bad(path, "lora_alpha", alpha, "a number > 0")
    for key, same in (("rank_pattern", r), ("alpha_pattern", alpha)):
        differing = {m: v for m, v in (raw.get(key) or {}).items() if v != same}
        if differing:
            raise _bad(path, key, differing, f"{{}} (one {key.split('_')[0]} for every module)")
    modules = raw.get("target_modules")
    if modules == "all-linear":
        targets = LORA_TARGETS
    elif isinstance(modules, list):
        names = [m.rsplit(".", 1)[-1] for m in modules]
        unknown = [m for m in modules if m.rsplit(".", 1)[-1] not in _BY_HF_NAME]
        if unknown or not modules:
            raise _bad(path, "target_modules", modules,
                       f"a non-empty list of {sorted(_BY_HF_NAME)} or 'all-linear' (no "
                       "embed_tokens / lm_head adapters)")
        targets = tuple(t for t in LORA_TARGETS if t in {_BY_HF_NAME[n] for n in names})
    else:
        raise _bad(path, "target_modules", modules,
                   f"a list of {sorted(_BY_HF_NAME)} or 'all-linear' (a regular expression is "
                   "not read)")
    try:
        return LoraConfig(rank=r, alpha=float(alpha), targets=targets,
                          rslora=bool(raw.get("use_rslora", False)))
    except ConfigError as e:
        raise CheckpointError(f"{path / CONFIG_FILE}: {e}") from e


def read_adapter(path: str | Path) -> tuple[LoraConfig, dict[str, np.ndarray]]:
    """(LoraConfig, PEFT tensors by name) of a PEFT LoRA adapter directory."""
    path = Path(path)
    if not (path / CONFIG_FILE).is_file():
        raise CheckpointError(f"{path}: no {CONFIG_FILE} (expected a PEFT adapter directory)")
    if not (path / WEIGHTS_FILE).is_file():
        found = sorted(p.name for p in path.iterdir())
        raise CheckpointError(f"{path}: no {WEIGHTS_FILE} (only safetensors adapters are "
                              f"read; found {found})")
    cfg = lora_config_from_peft(json.loads((path / CONFIG_FILE).read_text()), path)
    tensors = read_safetensors(path / WEIGHTS_FILE)
    extra = sorted(n for n in tensors if not n.endswith((".lora_A.weight", ".lora_B.weight")))
    if extra:
        raise CheckpointError(f"{path / WEIGHTS_FILE}: {len(extra)} tensor(s) that are not LoRA "
                              f"A/B weights, e.g. {extra[:3]}; jaxrl loads plain LoRA only")
    return cfg, tensors


# --------------------------------------------------------------------------- writing


def peft_config(lora_cfg: LoraConfig, base_model_name_or_path: str | None = None) -> dict:
    """The `adapter_config.json` dict of `lora_cfg`."""
    return {
        "peft_type": "LORA", "task_type": "CAUSAL_LM",
        "base_model_name_or_path": base_model_name_or_path,
        "r": lora_cfg.rank, "lora_alpha": lora_cfg.alpha, "use_rslora": lora_cfg.rslora,
        "target_modules": [MODULES[t].rsplit(".", 1)[1] for t in lora_cfg.targets],
        "lora_dropout": 0.0, "bias": "none", "fan_in_fan_out": False, "use_dora": False,
        "modules_to_save": None, "layers_to_transform": None, "layers_pattern": None,
        "rank_pattern": {}, "alpha_pattern": {}, "init_lora_weights": True,
        "inference_mode": True,
    }


def save_adapter(model, path: str | Path, cfg: ModelConfig | None = None, *,
                 base_model_name_or_path: str | None = None) -> Path:
    """Write the LoRA adapters as a PEFT adapter directory (`adapter_config.json` +
    `adapter_model.safetensors`, float32) that `peft.PeftModel.from_pretrained(base, path)`
    loads onto the Hugging Face form of the base.

    `model`: a `Transformer` whose `cfg.lora` is enabled, or pure-dict params (the whole model's,
    or the adapters alone, as a LoRA run's train state holds them) with their `ModelConfig` as
    `cfg`. `base_model_name_or_path` is recorded in the config (PEFT loads the base from it when
    it is not given one)."""
    if isinstance(model, dict):
        if cfg is None:
            raise CheckpointError("save_adapter: pure-dict params need their ModelConfig (cfg=)")
        params = model
    else:
        cfg = cfg or model.cfg
        params = nnx.to_pure_dict(nnx.state(model, nnx.Param))
    if not cfg.lora.enabled:
        raise CheckpointError("save_adapter: the model has no adapters (model.lora.rank=0); "
                              "save_pretrained writes a plain checkpoint")
    adapters = flatten_dict(lora.split(params)[1])
    amap = adapter_map(cfg)
    if set(adapters) != set(amap):
        missing = sorted(map(str, set(amap) - set(adapters)))[:3]
        raise CheckpointError(f"save_adapter: the params do not hold the adapters cfg.lora "
                              f"describes (targets {list(cfg.lora.targets)}); missing e.g. "
                              f"{missing}")
    tensors = {}
    for key, (name, _, to_peft) in amap.items():
        host = np.asarray(jax.device_get(adapters[key]), dtype=np.float32)
        tensors[name] = to_peft(host)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    write_safetensors(path / WEIGHTS_FILE, tensors)
    (path / CONFIG_FILE).write_text(
        json.dumps(peft_config(cfg.lora, base_model_name_or_path), indent=2))
    return path
