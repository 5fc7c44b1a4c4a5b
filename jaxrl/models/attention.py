"""The model's one attention entry point, with a switchable implementation.

Two call shapes cover everything the model does:

* `attention(q, k, v, segment_ids=...)` — self-attention over a whole sequence (training, scoring,
  prompt prefill). Causal by position index, restricted to equal segment ids (packing / padding).
* `cached_attention(q, k_cache, v_cache, q_positions, kv_lengths)` — queries at known positions
  attending to a KV cache whose rows hold `kv_lengths` valid entries (decode, chunked prefill).

`impl` is one of `xla | pallas | cudnn | auto`. `auto` resolves to Pallas kernels on TPU/GPU and
to the XLA reference on CPU. Shapes: q `[B, T, Hq, D]`, k/v `[B, S, Hkv, D]`, Hq % Hkv == 0.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

IMPLS = ("xla", "pallas", "cudnn", "auto")
_NEG_INF = -1e30


def resolve_impl(impl: str) -> str:
    """Resolve `auto` for the running backend; reject unknown names."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; valid choices: {list(IMPLS)}")
    if impl != "auto":
        return impl
    return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"


def _masked_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS, scale):
    """Reference attention with grouped-query heads and an explicit boolean mask (f32 softmax)."""
    b, t, hq, d = q_BTHD.shape
    hkv = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(b, t, hkv, hq // hkv, d)
    scores_BKGTS = jnp.einsum(
        "btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32
    ) * scale
    scores_BKGTS = jnp.where(mask_BTS[:, None, None, :, :], scores_BKGTS, _NEG_INF)
    probs_BKGTS = jax.nn.softmax(scores_BKGTS, axis=-1).astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs_BKGTS, v_BSKD)
    return out_BTKGD.reshape(b, t, hq, d)


def attention(q_BTHD, k_BSKD, v_BSKD, *, segment_ids_BT=None, impl: str = "xla"):
    """Causal self-attention within segments; segment id 0 marks padding (attends to padding)."""
    impl = resolve_impl(impl)
    scale = q_BTHD.shape[-1] ** -0.5
    if impl == "pallas":
        import kernels

        return kernels.flash_attention(
            q_BTHD, k_BSKD, v_BSKD, causal=True, segment_ids=segment_ids_BT, sm_scale=scale
        )
    if impl == "cudnn" and segment_ids_BT is None:
        return jax.nn.dot_product_attention(
            q_BTHD, k_BSKD, v_BSKD, is_causal=True, scale=scale, implementation="cudnn"
        )
    t, s = q_BTHD.shape[1], k_BSKD.shape[1]
    mask_BTS = (jnp.arange(t)[:, None] >= jnp.arange(s)[None, :])[None]
    if segment_ids_BT is not None:
        same_BTS = segment_ids_BT[:, :, None] == segment_ids_BT[:, None, :]
        mask_BTS = mask_BTS & same_BTS
    else:
        mask_BTS = jnp.broadcast_to(mask_BTS, (q_BTHD.shape[0], t, s))
    return _masked_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS, scale)


def cached_attention(q_BTHD, k_BSKD, v_BSKD, q_positions_BT, kv_lengths_B, *, impl: str = "xla"):
    """Queries at `q_positions` attend to cache entries `< kv_lengths` and `<=` their position."""
    impl = resolve_impl(impl)
    scale = q_BTHD.shape[-1] ** -0.5
    if impl == "pallas" and q_BTHD.shape[1] == 1:
        import kernels

        # The kernel's softmax scale is D**-0.5, as here; it reads only the valid prefix.
        return kernels.decode_attention(q_BTHD[:, 0], k_BSKD, v_BSKD, kv_lengths_B)[:, None]
    s = k_BSKD.shape[1]
    kpos_S = jnp.arange(s)
    mask_BTS = (kpos_S[None, None, :] <= q_positions_BT[:, :, None]) & (
        kpos_S[None, None, :] < kv_lengths_B[:, None, None]
    )
    return _masked_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS, scale)
