"""The dense projections of a decoder layer (`jaxrl.models.transformer`'s attention and MLP):
their einsums, and the layouts a generator's copy may hold them in: fused
(`Transformer.fuse_projections`), 8-bit (`Transformer.quantize`, `jaxrl.models.quant`) or
[out, in] on CPU (`Transformer.hold_out_in`, `jaxrl.models.lowp_dots`)."""

from __future__ import annotations

from flax import nnx

from jaxrl.models import lowp_dots, quant

# each projection's einsum: the input's subscripts, the weight's, the output's
SPECS = {"q_proj": "bte,ehd->bthd", "k_proj": "bte,ekd->btkd", "v_proj": "bte,ekd->btkd",
         "qkv_proj": "bte,ekgd->btkgd", "o_proj": "bthd,hde->bte", "gate_proj": "bte,ef->btf",
         "up_proj": "bte,ef->btf", "gate_up_proj": "bte,egf->btgf", "down_proj": "btf,fe->bte"}


def project(module, name: str, x, dt):
    """`einsum(SPECS[name], x, module.<name>)` with the weight in `dt`; a quantized module's
    weight is read in its 8-bit format and its per-output-channel scale (`<name>_scale`)
    applied to the result (`jaxrl.models.quant.quantized_einsum`); a module holding its weights
    output axes first (`lowp_dots.hold_out_in`) contracts them in that order."""
    w, spec = getattr(module, name)[...], SPECS[name]
    if module.quant_format is not None:
        return quant.quantized_einsum(spec, x.astype(dt), w,
                                      getattr(module, f"{name}_scale")[...], module.quant_format)
    if module.out_in:
        return lowp_dots.einsum_out_in(lowp_dots.out_in_spec(spec)[0], x, w.astype(dt))
    return lowp_dots.einsum(spec, x, w.astype(dt))


def quantize_projections(module, contracted: dict[str, int], fmt: str) -> None:
    """Replace each named projection (its first n axes contracted) by its values in the 8-bit
    format `fmt` (`jaxrl.models.quant.FORMATS`) and add `<name>_scale`, whose logical axes are
    the projection's output axes; with "w8a8" or "fp8" the forward pass quantizes each
    projection's input per token too."""
    quant.check_format(fmt)
    if module.quant_format is not None:
        raise ValueError(f"{type(module).__name__} is already quantized ({module.quant_format})")
    for name, n in contracted.items():
        param = getattr(module, name)
        axes = param.get_metadata()["logical_axes"]
        q, scale = quant.quantize_weight(param[...], n, fmt)
        setattr(module, name, nnx.Param(q, logical_axes=axes))
        setattr(module, f"{name}_scale", nnx.Param(scale, logical_axes=axes[n:]))
    module.quant_format = fmt


def check_fusable(module, lora_enabled: bool) -> None:
    name = type(module).__name__
    if module.fused:
        raise ValueError(f"{name}'s projections are already fused")
    if module.quant_format is not None:
        raise ValueError(f"{name} is quantized: fuse the projections before quantize()")
    if lora_enabled:
        raise ValueError(f"{name} has LoRA adapters: fused projections take no adapters (merge "
                         "them first; multi-adapter decode needs the unfused layout)")
