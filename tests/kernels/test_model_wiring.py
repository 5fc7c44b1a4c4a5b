"""attention_impl wiring: the model with impl="pallas" (kernels interpreted on CPU) generates the
same greedy tokens as impl="xla", and its full-sequence (flash) logits match."""

import jax.numpy as jnp
import numpy as np
import pytest

pytest.importorskip("jaxrl.models.attention")

from jaxrl.models.model import create_model  # noqa: E402
from jaxrl.models.transformer import KVCache  # noqa: E402
from jaxrl.testing import tiny_model_config  # noqa: E402

# GQA 4 (8 query heads, 2 kv heads), head_dim 64.
MODEL = dict(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=64)


def _model(impl):
    return create_model(tiny_model_config(attention_impl=impl, **MODEL), seed=0)


def _greedy(model, prompts_BT, prompt_lengths_B, steps):
    """Prefill each row's prompt into the cache, then decode greedily one token at a time."""
    cache = KVCache.init(model.cfg, batch=prompts_BT.shape[0], max_len=32)
    logits, cache = model.decode(prompts_BT, cache, num_valid_B=prompt_lengths_B)
    rows = jnp.arange(prompts_BT.shape[0])
    token_B = jnp.argmax(logits[rows, prompt_lengths_B - 1], axis=-1)
    out = [token_B]
    for _ in range(steps - 1):
        logits, cache = model.decode(token_B[:, None], cache)
        token_B = jnp.argmax(logits[:, 0], axis=-1)
        out.append(token_B)
    return np.stack([np.asarray(t) for t in out], axis=1)


def test_greedy_generation_pallas_equals_xla():
    prompts = jnp.asarray([[5, 17, 3, 99, 42, 8], [7, 0, 0, 0, 0, 0]], jnp.int32)
    lengths = jnp.asarray([6, 1], jnp.int32)  # very different lengths, one of length 1
    want = _greedy(_model("xla"), prompts, lengths, steps=5)
    got = _greedy(_model("pallas"), prompts, lengths, steps=5)
    np.testing.assert_array_equal(got, want)


def test_full_sequence_logits_pallas_match_xla_with_packing():
    tokens = jnp.asarray([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38]], jnp.int32)
    segments = jnp.asarray([[1, 1, 1, 1, 2, 2, 2, 2, 0, 0]], jnp.int32)  # two docs + padding
    want = _model("xla")(tokens, segment_ids_BT=segments)
    got = _model("pallas")(tokens, segment_ids_BT=segments)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=1e-4, rtol=1e-4)
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))
