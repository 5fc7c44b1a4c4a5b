"""The Hugging Face config keys of sliding-window attention and of the Gemma 2 / 3 families.

Read (`config_fields`) and written (`config_to_hf`) for `jaxrl.models.hf`: the window and the
layer pattern (`layer_types`, or the older `sliding_window_pattern`), the rope bases of Gemma 3's
and OLMo 3's two layer kinds, Gemma's `query_pre_attn_scalar` and soft-capping.
"""

from __future__ import annotations

from jaxrl.config import ModelConfig
from jaxrl.config.sections import GEMMA_ARCHITECTURES, LAYER_TYPES
from jaxrl.models.safetensors_io import CheckpointError

# when a checkpoint has no layer_types: layer i is full attention when (i + 1) % n == 0
# (transformers' defaults: Gemma 2 alternates, Gemma 3 has sliding_window_pattern, OLMo 3 4)
_FULL_EVERY = {"gemma2": 2, "gemma3": 6, "olmo3": 4}
_DEFAULT_THETA = {"gemma3": (1_000_000.0, 10_000.0)}  # (full, sliding) without any in config
GELU_TANH = ("gelu_pytorch_tanh", "gelu_tanh")


def _layer_types(arch: str, hf: dict) -> tuple[str, ...]:
    n = hf["num_hidden_layers"]
    types = hf.get("layer_types")
    if types:
        bad = [t for t in types if t not in LAYER_TYPES]
        if bad or len(types) != n:
            raise CheckpointError(f"layer_types {types!r}: need one of {list(LAYER_TYPES)} for "
                                  f"each of the {n} layers")
        return tuple(types)
    if arch not in _FULL_EVERY:
        return ()  # Mistral, Mixtral, Phi-3: every layer slides when there is a window
    every = int(hf.get("sliding_window_pattern") or _FULL_EVERY[arch])
    return tuple("full_attention" if (i + 1) % every == 0 else "sliding_attention"
                 for i in range(n))


def _rope_thetas(arch: str, hf: dict) -> tuple[dict, dict | None]:
    """`(full, sliding)` rope parameter dicts: `rope_parameters` keyed by layer type (newer
    configs), else the legacy `rope_theta` / `rope_local_base_freq` / `rope_scaling`."""
    full_default, local_default = _DEFAULT_THETA.get(arch, (10_000.0, None))
    params = dict(hf.get("rope_parameters") or {})
    if "full_attention" in params or "sliding_attention" in params:
        full = {**(hf.get("rope_scaling") or {}), **(params.get("full_attention") or {})}
        local = dict(params.get("sliding_attention") or {})
    else:
        full = {**(hf.get("rope_scaling") or {}), **params}
        local = {}
    full.setdefault("rope_theta", hf.get("rope_theta", full_default))
    if arch == "gemma3":
        local.setdefault("rope_theta", hf.get("rope_local_base_freq", local_default))
    elif local:
        local.setdefault("rope_theta", full["rope_theta"])
    local_type = local.get("rope_type", local.get("type", "default"))
    if local_type not in ("default", None):
        raise CheckpointError(f"sliding layers' rope_type {local_type!r} is not supported; "
                              "supported: default")
    return full, (local or None)


def config_fields(arch: str, hf: dict, windowed: bool) -> tuple[dict, dict]:
    """`(fields, full_rope)`: ModelConfig fields of the window (when the architecture is
    `windowed`), the layer kinds and Gemma's extras, and the rope parameters of the
    full-attention layers (for the caller's rope_type check)."""
    full, local = _rope_thetas(arch, hf)
    window = hf.get("sliding_window") if windowed else None
    fields = dict(sliding_window=int(window) if window else None,
                  layer_types=_layer_types(arch, hf) if window else ())
    if local is not None and float(local["rope_theta"]) != float(full["rope_theta"]):
        fields["rope_local_theta"] = float(local["rope_theta"])
    if arch in GEMMA_ARCHITECTURES:
        act = hf.get("hidden_activation") or hf.get("hidden_act") or GELU_TANH[0]
        if act not in GELU_TANH:
            raise CheckpointError(f"{arch}: hidden_activation {act!r} is not supported; "
                                  f"supported: {list(GELU_TANH)}")
        for key in ("attention_bias", "use_bidirectional_attention"):  # (EmbeddingGemma's)
            if hf.get(key):
                raise CheckpointError(f"{arch}: {key}=true is not supported; supported: false")
        fields.update(
            query_pre_attn_scalar=float(hf.get("query_pre_attn_scalar")
                                        or hf.get("head_dim")
                                        or hf["hidden_size"] // hf["num_attention_heads"]),
            attn_logit_softcap=_cap(hf.get("attn_logit_softcapping")),
            final_logit_softcap=_cap(hf.get("final_logit_softcapping")),
            tie_embeddings=bool(hf.get("tie_word_embeddings", True)),
            qk_norm=arch == "gemma3",
        )
    return fields, full


def _cap(value) -> float | None:
    return float(value) if value else None


def config_to_hf(cfg: ModelConfig) -> dict:
    """The HF keys of `cfg`'s window, layer kinds, rope bases and Gemma extras."""
    out: dict = {"sliding_window": cfg.sliding_window}
    if cfg.layer_types:
        out["layer_types"] = list(cfg.layer_types)
    elif cfg.sliding_window is not None and cfg.architecture in _FULL_EVERY:
        out["layer_types"] = ["sliding_attention"] * cfg.num_layers
    elif cfg.architecture in _FULL_EVERY:  # no window: every layer full attention
        out["layer_types"] = ["full_attention"] * cfg.num_layers
    local = cfg.rope_theta if cfg.rope_local_theta is None else cfg.rope_local_theta
    if cfg.architecture == "gemma3":
        out["rope_local_base_freq"] = local  # read by transformers 4.x and 5.x alike
    elif cfg.rope_local_theta is not None:
        raise CheckpointError(f"a {cfg.architecture} checkpoint has one rope base; "
                              f"rope_local_theta={cfg.rope_local_theta} needs gemma3")
    if cfg.architecture in GEMMA_ARCHITECTURES:
        scalar = cfg.query_pre_attn_scalar or cfg.head_size
        out.update(hidden_activation=GELU_TANH[0], attention_bias=False,
                   # an int where it is one: transformers 5's strict config takes only ints
                   query_pre_attn_scalar=int(scalar) if float(scalar).is_integer() else scalar,
                   attn_logit_softcapping=cfg.attn_logit_softcap,
                   final_logit_softcapping=cfg.final_logit_softcap)
        if cfg.architecture == "gemma2" and cfg.qk_norm:
            raise CheckpointError("a gemma2 checkpoint has no q/k norms")
    return out
