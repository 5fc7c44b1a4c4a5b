"""Decoder-only transformer (Llama / Qwen2 / Qwen3), sharded creation, Hugging Face I/O."""

from jaxrl.models.model import create_model, param_count
from jaxrl.models.transformer import KVCache, Transformer

__all__ = ["KVCache", "Transformer", "create_model", "load_pretrained", "param_count",
           "save_pretrained"]


def __getattr__(name):  # keep `import jaxrl.models` free of safetensors/json work until needed
    if name in ("load_pretrained", "save_pretrained"):
        from jaxrl.models import hf

        return getattr(hf, name)
    raise AttributeError(name)
