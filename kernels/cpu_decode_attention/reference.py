"""Pure-jnp reference for ``write_and_attend`` (the same contract, f32 sums)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def write_and_attend_reference(q_BHD, k_new_BKD, v_new_BKD, k_cache_BKDS, v_cache_BKSD, slot_B,
                               n_B, scale: float):
    b, hq, d = q_BHD.shape
    hkv, s = k_cache_BKDS.shape[1], k_cache_BKDS.shape[3]
    hit_BS = jnp.arange(s)[None, :] == jnp.clip(slot_B, 0, s - 1)[:, None]
    k = jnp.where(hit_BS[:, None, None, :], k_new_BKD[..., None].astype(k_cache_BKDS.dtype),
                  k_cache_BKDS)
    v = jnp.where(hit_BS[:, None, :, None], v_new_BKD[:, :, None, :].astype(v_cache_BKSD.dtype),
                  v_cache_BKSD)
    q = q_BHD.astype(jnp.float32).reshape(b, hkv, hq // hkv, d) * scale
    scores = jnp.einsum("bkgd,bkds->bkgs", q, k.astype(jnp.float32))
    mask = (jnp.arange(s)[None, :] < jnp.clip(n_B, 1, s)[:, None])[:, None, None, :]
    probs = jax.nn.softmax(jnp.where(mask, scores, -jnp.inf), axis=-1)
    out = jnp.einsum("bkgs,bksd->bkgd", probs, v.astype(jnp.float32))
    return out.reshape(b, hq, d).astype(q_BHD.dtype), k, v
