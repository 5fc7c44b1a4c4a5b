"""The model's one attention entry point, with a switchable implementation.

Two call shapes cover everything the model does:

* `attention(q, k, v, segment_ids=...)` — self-attention over a whole sequence (training, scoring,
  prompt prefill). Causal by position index, restricted to equal segment ids (packing / padding).
* `cached_attention(q, k_cache, v_cache, q_positions, kv_lengths)` — queries at known positions
  attending to a KV cache whose rows hold `kv_lengths` valid entries (decode, chunked prefill).

Options every path takes (Gemma 2 / 3, Mistral, OLMo 3): `window` -- sliding-window attention
with Hugging Face's definition (`transformers.masking_utils.sliding_window_overlay`): a query at
position p sees the keys at positions k with p - window < k <= p, i.e. its own and the
window - 1 before it (a real mask: the positions run on past the window); `softcap` -- scores
become `softcap * tanh(scores / softcap)` before the mask (Gemma 2); `scale` -- the score scale
(default D**-0.5; Gemma: `query_pre_attn_scalar**-0.5`). The Pallas kernels take all three
(skipping the blocks wholly outside the window; the flash kernel's backward carries the cap's
slope); a soft-capped or windowed call under `cudnn` runs the XLA path.

`impl` is one of `xla | pallas | cudnn | auto`. `auto` resolves to Pallas kernels on TPU/GPU and
to the XLA reference on CPU. Shapes: q `[B, T, Hq, D]`, k/v `[B, S, Hkv, D]`, Hq % Hkv == 0; a
heads-major KV cache (`heads_major=True`) holds keys `[B, Hkv, D, S]` and values `[B, Hkv, S, D]`
(`jaxrl.models.transformer.KVCache`).

Sharding: a `pallas_call` has no SPMD partitioning rule, so with impl "pallas" under a mesh set
by `jax.set_mesh` (trainer or generator mesh) the kernels run inside `jax.shard_map`, batch rows
over the role's `batch` mesh axis and kv heads (with their query heads) over its `kv_heads` axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

import jaxrl_kernels
from jaxrl.models import lowp_dots
from jaxrl.sharding import logical_to_spec, mesh_role

IMPLS = ("xla", "pallas", "cudnn", "auto")
_NEG_INF = -1e30


def resolve_impl(impl: str) -> str:
    """Resolve `auto` for the running backend; reject unknown names."""
    if impl not in IMPLS:
        raise ValueError(f"unknown attention_impl {impl!r}; valid choices: {list(IMPLS)}")
    if impl != "auto":
        return impl
    return "pallas" if jax.default_backend() in ("tpu", "gpu") else "xla"


@jax.custom_vjp
def masked_softmax(scores, mask):
    """`jax.nn.softmax(where(mask, scores, -1e30), axis=-1)` whose backward keeps only the
    output y (and the mask): d scores = y * (g - sum(g * y)), 0 where masked. Differentiated as
    written, it keeps the masked scores, their `exp` and y -- three f32 [B, K, G, T, S] arrays
    per attention block, a tenth of the train step's activations at short lengths
    (docs/benchmarks.md, memory of the RL step)."""
    return jax.nn.softmax(jnp.where(mask, scores, _NEG_INF), axis=-1)


def _masked_softmax_fwd(scores, mask):
    y = masked_softmax(scores, mask)
    return y, (y, mask)  # the mask as passed: broadcast over heads, bool


def _masked_softmax_bwd(res, g):
    y, mask = res  # masked scores get no gradient (a row that sees no key is uniform in y)
    return jnp.where(mask, y * (g - jnp.sum(g * y, axis=-1, keepdims=True)), 0.0), None


masked_softmax.defvjp(_masked_softmax_fwd, _masked_softmax_bwd)


def soft_cap(x, cap: float | None):
    """`cap * tanh(x / cap)` (Gemma 2's logit soft-capping), or `x` when `cap` is None."""
    return x if cap is None else cap * jnp.tanh(x / cap)


def window_mask(q_pos, k_pos, window: int | None):
    """Keys a query may see under a sliding `window` (None: all): `k_pos > q_pos - window`;
    with causality (`k_pos <= q_pos`) the `window` positions ending at the query's own."""
    return True if window is None else k_pos > q_pos - window


def masked_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS, scale, softcap: float | None = None):
    """Reference attention with grouped-query heads and an explicit boolean mask (f32 softmax);
    `softcap`: scores soft-capped before the mask."""
    b, t, hq, d = q_BTHD.shape
    hkv = k_BSKD.shape[2]
    q_BTKGD = q_BTHD.reshape(b, t, hkv, hq // hkv, d)
    scores_BKGTS = soft_cap(jnp.einsum(
        "btkgd,bskd->bkgts", q_BTKGD, k_BSKD, preferred_element_type=jnp.float32
    ) * scale, softcap)
    probs_BKGTS = masked_softmax(scores_BKGTS, mask_BTS[:, None, None, :, :])
    probs_BKGTS = probs_BKGTS.astype(v_BSKD.dtype)
    out_BTKGD = jnp.einsum("bkgts,bskd->btkgd", probs_BKGTS, v_BSKD)
    return out_BTKGD.reshape(b, t, hq, d)


def attention(q_BTHD, k_BSKD, v_BSKD, *, segment_ids_BT=None, impl: str = "xla",
              window: int | None = None, softcap: float | None = None,
              scale: float | None = None):
    """Causal self-attention within segments; segment id 0 marks padding (attends to padding).
    `window`, `softcap`, `scale`: see the module docstring (the window counts in sequence
    index, which within a segment is position)."""
    impl = resolve_impl(impl)
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    if impl == "pallas":
        return _pallas_flash(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, scale, window, softcap)
    if impl == "cudnn" and segment_ids_BT is None and window is None and softcap is None:
        return jax.nn.dot_product_attention(
            q_BTHD, k_BSKD, v_BSKD, is_causal=True, scale=scale, implementation="cudnn"
        )
    return _blocked_causal_attention(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, scale, window,
                                     softcap)


def kernel_shard_axes(batch: int, num_kv_heads: int):
    """`(mesh, batch_axis, heads_axis)` to run a Pallas kernel per shard, or None to call it whole.

    The mesh is the one in context (`jax.set_mesh`; inside `jit`, its abstract mesh). Batch rows go
    over the role's `batch` mesh axis and kv heads over its `kv_heads` axis, each only when the
    axis has more than one device, is not already manual (an enclosing `shard_map`) and divides
    the dimension evenly; otherwise that dimension is replicated. None when nothing is split: no
    mesh, a 1-device mesh, or a mesh that is neither the trainer's nor the generator's.
    """
    mesh = jax.sharding.get_abstract_mesh()
    role = None if mesh.empty else mesh_role(mesh)
    if role is None:
        return None
    spec = logical_to_spec(("batch", "kv_heads"), role, mesh, (batch, num_kv_heads))
    axes = tuple(
        a if a is not None and mesh.shape[a] > 1 and a not in mesh.manual_axes else None
        for a in spec
    )
    return None if axes == (None, None) else (mesh, *axes)


def _pallas_flash(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, scale, window=None, softcap=None):
    """`jaxrl_kernels.flash_attention` (causal), per shard when a mesh splits batch or kv heads.

    Query heads shard with their kv heads: with Hkv divisible by the axis, each shard's query heads
    [i * Hq / n, (i + 1) * Hq / n) use exactly its kv heads. The kernel's custom_vjp runs per shard
    too (shard_map transposes to per-shard backward kernels).

    check_vma=False (here and in decode): on jax 0.10.2 Pallas' generic interpreter (CPU) rejects,
    under vma checks, a dynamic_slice by grid indices of scalar-prefetch operands that vary over a
    mesh axis (the segment block table, the decode lengths); compiled lowerings never run it. The
    bodies have no collectives for the check to guard, and without it shard_map's transpose still
    sums the cotangents of inputs replicated over an axis (a non-dividing batch or head count)."""
    flash = functools.partial(jaxrl_kernels.flash_attention, causal=True, sm_scale=scale,
                              window=window, softcap=softcap)
    sharded = kernel_shard_axes(q_BTHD.shape[0], k_BSKD.shape[2])
    if sharded is None:
        return flash(q_BTHD, k_BSKD, v_BSKD, segment_ids=segment_ids_BT)
    mesh, b, h = sharded
    seq = P(b, None, h, None)
    if segment_ids_BT is None:
        args, specs = (q_BTHD, k_BSKD, v_BSKD), (seq, seq, seq)
    else:
        args, specs = (q_BTHD, k_BSKD, v_BSKD, segment_ids_BT), (seq, seq, seq, P(b, None))
    body = lambda q, k, v, seg=None: flash(q, k, v, segment_ids=seg)
    fn = jax.shard_map(body, mesh=mesh, in_specs=specs, out_specs=seq, check_vma=False)
    return fn(*args)


def _pallas_decode(q_BHD, k_BSKD, v_BSKD, kv_lengths_B, scale=None, window=None, softcap=None):
    """`jaxrl_kernels.decode_attention`, per shard when a mesh splits batch (slots) or kv heads."""
    decode = functools.partial(jaxrl_kernels.decode_attention, sm_scale=scale, window=window,
                               softcap=softcap)
    sharded = kernel_shard_axes(q_BHD.shape[0], k_BSKD.shape[2])
    if sharded is None:
        return decode(q_BHD, k_BSKD, v_BSKD, kv_lengths_B)
    mesh, b, h = sharded
    seq = P(b, None, h, None)
    fn = jax.shard_map(
        decode,
        mesh=mesh,
        in_specs=(P(b, h, None), seq, seq, P(b)),
        out_specs=P(b, h, None),
        check_vma=False,
    )
    return fn(q_BHD, k_BSKD, v_BSKD, kv_lengths_B)


def query_blocks(t: int, *, min_block: int = 64, max_blocks: int = 16) -> list[tuple[int, int]]:
    """[start, end) query blocks for `_blocked_causal_attention`: blocks of >= `min_block` rows,
    at most `max_blocks` of them (each block is its own unrolled einsum; few blocks keep the HLO
    and the compile small at long T). The last block may be shorter."""
    size = max(min_block, -(-t // max_blocks))
    return [(i, min(i + size, t)) for i in range(0, t, size)]


def _blocked_causal_attention(q_BTHD, k_BSKD, v_BSKD, segment_ids_BT, scale, window=None,
                              softcap=None):
    """Exact causal attention, one query block at a time against only the keys at or before it.

    Queries in rows [i, e) never see keys >= e, so each block attends to `k[:, :e]`: about half
    the score FLOPs and memory of the full T x T product, and blocks of scores that stay in cache
    (on a 2-core CPU, T=512, 8 heads: ~3x faster forward + backward than the full masked product).
    Each block's softmax is exact (its key range is complete), so no online rescaling is needed.
    With a `window` a block's keys start at `i - window + 1`: the ones before are all masked."""
    b, t = q_BTHD.shape[:2]
    if k_BSKD.shape[1] != t:
        raise ValueError(
            f"self-attention needs as many keys as queries; got T={t}, "
            f"S={k_BSKD.shape[1]} (use cached_attention for a KV cache)"
        )
    seg_BT = segment_ids_BT if segment_ids_BT is not None else jnp.ones((b, t), jnp.int32)
    outs = []
    for i, e in query_blocks(t):
        s0 = 0 if window is None else max(0, i - window + 1)
        q_T, k_S = jnp.arange(i, e)[:, None], jnp.arange(s0, e)[None, :]
        causal_TS = (q_T >= k_S) & window_mask(q_T, k_S, window)
        mask_BTS = causal_TS[None] & (seg_BT[:, i:e, None] == seg_BT[:, None, s0:e])
        outs.append(masked_attention(q_BTHD[:, i:e], k_BSKD[:, s0:e], v_BSKD[:, s0:e], mask_BTS,
                                     scale, softcap))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def cached_attention(q_BTHD, k_cache, v_cache, q_positions_BT, kv_lengths_B, *,
                     impl: str = "xla", heads_major: bool = False, window: int | None = None,
                     softcap: float | None = None, scale: float | None = None):
    """Queries at `q_positions` attend to cache entries `< kv_lengths` and `<=` their position
    (and, with a `window`, `> position - window`: the whole cache is kept, the window masks it).

    The cache is `[B, S, K, D]` keys and values, or with `heads_major` keys `[B, K, D, S]` and
    values `[B, K, S, D]`: each the right-hand side of its product in `[batch, contracted,
    out]` order, so XLA:CPU runs both dots on the cache as it lies, where the sequence-major
    cache is transposed (copied whole) for them at every decode step (docs/design.md).
    """
    impl = resolve_impl(impl)
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    if impl == "pallas" and q_BTHD.shape[1] == 1:
        if heads_major:  # the kernel reads [B, S, K, D]; engines pick that layout for it
            k_cache, v_cache = k_cache.transpose(0, 3, 1, 2), v_cache.transpose(0, 2, 1, 3)
        # The kernel's query sits at kv_lengths - 1; it reads only the valid prefix (with a
        # window, only the blocks the window touches).
        return _pallas_decode(q_BTHD[:, 0], k_cache, v_cache, kv_lengths_B, scale,
                              window, softcap)[:, None]
    s = k_cache.shape[-1] if heads_major else k_cache.shape[1]
    kpos_S, qpos_BT1 = jnp.arange(s), q_positions_BT[:, :, None]
    mask_BTS = (kpos_S[None, None, :] <= qpos_BT1) & (
        kpos_S[None, None, :] < kv_lengths_B[:, None, None]
    ) & window_mask(qpos_BT1, kpos_S[None, None, :], window)
    if not heads_major:
        return masked_attention(q_BTHD, k_cache, v_cache, mask_BTS, scale, softcap)
    # Query rows M = (G, T) per kv head, as one [B, K, M, D] operand: written as a 5-D einsum,
    # XLA:CPU makes the cache the dot's left side and leaves the fast dot library.
    b, t, hq, d = q_BTHD.shape
    hkv = k_cache.shape[1]
    g = hq // hkv
    q_BKMD = q_BTHD.reshape(b, t, hkv, g, d).transpose(0, 2, 3, 1, 4).reshape(b, hkv, g * t, d)
    scores_BKMS = soft_cap(jnp.einsum("bkmd,bkds->bkms", q_BKMD, k_cache,
                                      preferred_element_type=jnp.float32) * scale, softcap)
    probs_BKGTS = masked_softmax(scores_BKMS.reshape(b, hkv, g, t, s),
                                 mask_BTS[:, None, None, :, :])
    probs_BKMS = probs_BKGTS.reshape(b, hkv, g * t, s).astype(v_cache.dtype)
    out_BKMD = lowp_dots.einsum("bkms,bksd->bkmd", probs_BKMS, v_cache)
    return out_BKMD.reshape(b, hkv, g, t, d).transpose(0, 3, 1, 2, 4).reshape(b, t, hq, d)
