"""Pure-jnp reference for flash attention (what the kernels are tested against)."""

from __future__ import annotations

import jax
import jax.numpy as jnp


def attention_mask(T: int, S: int, causal: bool, segment_ids=None, window: int | None = None):
    """Mask [B or 1, T, S]; causal is top-left aligned (key j visible to query i iff j<=i).

    ``window`` (with causal) also hides keys j <= i - window: query i sees i - window < j <= i.
    """
    mask_TS = jnp.ones((T, S), dtype=bool)
    if causal:
        mask_TS = jnp.arange(S)[None, :] <= jnp.arange(T)[:, None]
    if window is not None:
        mask_TS = mask_TS & (jnp.arange(S)[None, :] > jnp.arange(T)[:, None] - window)
    mask_BTS = mask_TS[None]
    if segment_ids is not None:
        seg_BT = segment_ids
        mask_BTS = mask_BTS & (seg_BT[:, :, None] == seg_BT[:, None, :])
    return mask_BTS


def flash_attention_reference(
    q, k, v, *, causal=True, segment_ids=None, sm_scale=None, window=None, softcap=None
):
    """softmax(cap(q k^T * scale) + mask) v in f32; rows with no visible key give 0.

    q [B, T, Hq, D], k/v [B, S, Hkv, D], Hq a multiple of Hkv (query head n uses kv head n // G),
    segment_ids [B, T] (requires T == S). ``window``: query i sees keys i - window < j <= i (the
    sliding window of transformers' ``sliding_window_overlay``: kv_idx > q_idx - window).
    ``softcap``: cap(s) = softcap * tanh(s / softcap) (Gemma 2), identity when None.
    """
    B, T, Hq, D = q.shape
    S, Hkv = k.shape[1], k.shape[2]
    G = Hq // Hkv
    scale = D**-0.5 if sm_scale is None else sm_scale
    q5 = q.astype(jnp.float32).reshape(B, T, Hkv, G, D)
    s = jnp.einsum("bthgd,bshd->bhgts", q5, k.astype(jnp.float32)) * scale
    if softcap is not None:
        s = softcap * jnp.tanh(s / softcap)
    mask = attention_mask(T, S, causal, segment_ids, window)[:, None, None]
    s = jnp.where(mask, s, -jnp.inf)
    p = jax.nn.softmax(s, axis=-1)
    p = jnp.where(mask, p, 0.0)  # fully-masked rows: softmax gives NaN; define them as 0
    o = jnp.einsum("bhgts,bshd->bthgd", p, v.astype(jnp.float32))
    return o.reshape(B, T, Hq, D).astype(q.dtype)
