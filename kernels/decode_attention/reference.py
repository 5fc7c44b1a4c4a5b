"""Pure-jnp reference for single-token decode attention over a contiguous KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_attention_reference(q, k_cache, v_cache, lengths, *, sm_scale=None):
    """q [B, Hq, D], caches [B, S, Hkv, D], lengths [B]: attend to positions < lengths[b]."""
    B, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if sm_scale is None else sm_scale
    q4 = q.astype(jnp.float32).reshape(B, Hkv, G, D)
    s = jnp.einsum("bhgd,bshd->bhgs", q4, k_cache.astype(jnp.float32)) * scale
    mask = (jnp.arange(S)[None, :] < lengths[:, None])[:, None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    o = jnp.einsum("bhgs,bshd->bhgd", p, v_cache.astype(jnp.float32))
    return o.reshape(B, Hq, D).astype(q.dtype)
