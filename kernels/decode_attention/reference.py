"""Pure-jnp reference for single-token decode attention over a contiguous KV cache."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def decode_attention_reference(
    q, k_cache, v_cache, lengths, *, sm_scale=None, window=None, softcap=None
):
    """q [B, Hq, D], caches [B, S, Hkv, D], lengths [B]: attend to positions < lengths[b].

    ``window``: the query sits at position lengths[b] - 1 and sees positions p with
    lengths[b] - 1 - window < p (transformers' sliding window: kv_idx > q_idx - window).
    ``softcap``: scaled scores s -> softcap * tanh(s / softcap) before the mask."""
    B, Hq, D = q.shape
    S, Hkv = k_cache.shape[1], k_cache.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if sm_scale is None else sm_scale
    q4 = q.astype(jnp.float32).reshape(B, Hkv, G, D)
    s = jnp.einsum("bhgd,bshd->bhgs", q4, k_cache.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask_BS = jnp.arange(S)[None, :] < lengths[:, None]
    if window is not None:
        mask_BS = mask_BS & (jnp.arange(S)[None, :] >= lengths[:, None] - window)
    mask = mask_BS[:, None, None, :]
    s = jnp.where(mask, s, -jnp.inf)
    p = jnp.where(mask, jax.nn.softmax(s, axis=-1), 0.0)
    o = jnp.einsum("bhgs,bshd->bhgd", p, v_cache.astype(jnp.float32))
    return o.reshape(B, Hq, D).astype(q.dtype)
