"""The KV cache's heads-major layout: what it is for (no per-step copy of the cache on XLA:CPU)
and that it decodes exactly as the sequence-major one."""

import functools
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import KVCache, create_model
from jaxrl.testing import tiny_model_config

B, S = 8, 48


def _step_fn(model):
    @functools.partial(jax.jit, donate_argnums=(0,))  # as the engine: the cache updated in place
    def step(cache, tok_B):
        logits, cache = model.decode(tok_B[:, None], cache)
        return logits[:, 0], cache
    return step


def _cache_copies(model, cfg, heads_major: bool) -> list[str]:
    """Ops in the compiled decode step that transpose or copy a whole cache layer."""
    cache = KVCache.init(cfg, B, S, heads_major=heads_major)
    hlo = _step_fn(model).lower(cache, jnp.zeros((B,), jnp.int32)).compile().as_text()
    size = B * S * cfg.num_kv_heads * cfg.head_size
    found = []
    for line in hlo.splitlines():
        m = re.match(r"\s*(?:ROOT )?%(\S+) = f32\[([\d,]+)\]\S* (\w+)\(", line)
        if not m or "fused_computation" in line.split("=")[0]:
            continue
        name, dims, op = m.groups()
        if np.prod([int(d) for d in dims.split(",")]) == size and (
                "transpose" in name or op in ("transpose", "copy")):
            found.append(name)
    return found


def test_heads_major_decode_step_does_not_copy_the_cache():
    cfg = tiny_model_config(num_heads=4, num_kv_heads=2)
    model = create_model(cfg, seed=0)
    assert KVCache.default_heads_major(cfg)  # XLA attention on CPU
    # the sequence-major cache is transposed for the attention dots at every step: the check
    # sees it, so it can fail
    assert _cache_copies(model, cfg, heads_major=False)
    assert _cache_copies(model, cfg, heads_major=True) == []


@pytest.mark.parametrize("num_kv_heads", [1, 2])
def test_layouts_decode_alike(num_kv_heads):
    cfg = tiny_model_config(num_heads=4, num_kv_heads=num_kv_heads)
    model = create_model(cfg, seed=1)
    rng = np.random.default_rng(0)
    prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (B, 7)), jnp.int32)
    valid = jnp.asarray(rng.integers(3, 8, B), jnp.int32)
    step = _step_fn(model)
    out = {}
    for heads_major in (True, False):
        cache = KVCache.init(cfg, B, S, heads_major=heads_major)
        _, cache = model.decode(prompt, cache, num_valid_B=valid)
        tok, rows = prompt[:, 0], []
        for _ in range(5):
            logits, cache = step(cache, tok)
            tok = jnp.argmax(logits, -1)
            rows.append(np.asarray(logits))
        out[heads_major] = np.stack(rows)
    np.testing.assert_allclose(out[True], out[False], atol=1e-5, rtol=0)
