"""Named model shapes, defined once: the tiny model the tests, demos and quick benchmarks use, and
the default model of the synthetic tasks. Imports no JAX (experiment files use these).

    tiny_model_config()       2 layers, width 64, 4 heads (2 KV), vocab 128: unit tests, demos
    tiny_task_model_config()  the same family at 4 layers, width 128 (~0.8M params): the default
                              model of the synthetic tasks with the char tokenizer

Each takes `ModelConfig` field overrides, e.g. `tiny_model_config(attention_impl="pallas")`.
"""

from __future__ import annotations

from jaxrl.config import ModelConfig

# vocab 128 >= the char tokenizer's 100 symbols; Qwen2-style q/k/v biases, tied embeddings.
TINY = dict(architecture="qwen2", vocab_size=128, hidden_size=64, intermediate_size=128,
            num_layers=2, num_heads=4, num_kv_heads=2, qkv_bias=True, tie_embeddings=True)
TINY_TASK = dict(TINY, hidden_size=128, intermediate_size=384, num_layers=4,
                 max_position_embeddings=256)


def tiny_model_config(**overrides) -> ModelConfig:
    """A 2-layer model small enough for unit tests and CPU demos."""
    return ModelConfig(**{**TINY, **overrides})


def tiny_task_model_config(**overrides) -> ModelConfig:
    """The default model for the synthetic tasks with the char tokenizer (~0.8M params)."""
    return ModelConfig(**{**TINY_TASK, **overrides})
