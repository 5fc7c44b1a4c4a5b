"""The contiguous KV cache of generation: per-layer keys and values and each row's length.

A sliding-window layer (`ModelConfig.layer_window`) whose window is shorter than the cache can
keep only its window (`KVCache.init(..., ring=True)`, what the generation engine makes): a ring
of `window` slots where position p lies in slot `p % window`. One decode step writes its token,
then attends to the ring's `min(length, window)` valid slots -- exactly the window's keys, in
another order, which softmax does not see -- through `cached_attention` with no window (the
Pallas decode kernel as for any cache). T > 1 new tokens attend to the ring's old entries and
to each other by their positions (`ring_attention`); `with_layers` then writes only the valid
ones (a padded prefill's padding never evicts a kept position). A full layer (and a sliding one
under the default `ring=False`) keeps every position, the window masking it
(`jaxrl.models.attention.cached_attention`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.config import ModelConfig
from jaxrl.models import lowp_dots
from jaxrl.models.attention import (
    cached_attention,
    masked_attention,
    resolve_impl,
    window_mask,
)
from jaxrl_kernels import cpu_decode_attention

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


def ring_sizes(cfg: ModelConfig, max_len: int) -> tuple[int, ...]:
    """Per layer, the ring a cache of `max_len` positions keeps: the window of a sliding layer
    whose window is shorter than `max_len`, else 0 (the layer keeps all `max_len`)."""
    windows = (cfg.layer_window(i) for i in range(cfg.num_layers))
    return tuple(w if w is not None and w < max_len else 0 for w in windows)


def layer_lengths(cfg: ModelConfig, max_len: int, ring: bool = True) -> tuple[int, ...]:
    """Positions each layer's cache holds (the memory plan's and the planner's KV figure)."""
    sizes = ring_sizes(cfg, max_len) if ring else (0,) * cfg.num_layers
    return tuple(r or max_len for r in sizes)


def ring_positions(lengths_B, size: int):
    """The position each slot of a `size`-slot ring holds once a row holds `lengths_B` tokens:
    int32 `[B, size]`, -1 where the slot holds none yet (slot j: the last position p <
    length with p % size == j)."""
    last_B1 = lengths_B[:, None].astype(jnp.int32) - 1
    pos_BR = last_B1 - jnp.mod(last_B1 - jnp.arange(size, dtype=jnp.int32)[None], size)
    return jnp.where(pos_BR >= 0, pos_BR, -1)


def ring_attention(q_BTHD, k_BSKD, v_BSKD, q_positions_BT, kv_positions_BS, *,
                   window: int | None = None, softcap: float | None = None,
                   scale: float | None = None):
    """Queries at `q_positions` attend to keys by the positions they hold (`kv_positions`, -1:
    none), causally and within the `window`: a cache whose slot order is not position order."""
    scale = q_BTHD.shape[-1] ** -0.5 if scale is None else scale
    qpos_BT1, kpos_B1S = q_positions_BT[:, :, None], kv_positions_BS[:, None, :]
    mask_BTS = (kpos_B1S >= 0) & (kpos_B1S <= qpos_BT1) & window_mask(qpos_BT1, kpos_B1S,
                                                                     window)
    return masked_attention(q_BTHD, k_BSKD, v_BSKD, mask_BTS, scale, softcap)


def ring_slots(start_B, lengths_B, t: int, size: int):
    """The ring slots of each row's T new positions `start + t`: `p % size` for those that are
    valid (< the new `lengths_B`) and kept (the last `size`), `size` (out of range: a write
    drops it) for the others."""
    pos_BT = start_B[:, None] + jnp.arange(t, dtype=jnp.int32)[None]
    keep_BT = (pos_BT < lengths_B[:, None]) & (pos_BT >= lengths_B[:, None] - size)
    return jnp.where(keep_BT, pos_BT % size, size)


def ring_write(ring, new_BT, start_B, lengths_B, axis: int):
    """Write each row's T new entries (positions `start + t`) into its ring along `axis` (the
    row's sequence axis; `new_BT` laid out as `ring` with T there), only those `ring_slots`
    keeps."""
    slot_BT = ring_slots(start_B, lengths_B, new_BT.shape[axis + 1], ring.shape[axis + 1])
    if _select_one(ring, new_BT, axis):
        return _select_write(ring, new_BT, slot_BT[:, 0], axis)  # slot `size`: dropped

    def write(r, n, s):
        r, n = jnp.moveaxis(r, axis, 0), jnp.moveaxis(n.astype(r.dtype), axis, 0)
        return jnp.moveaxis(r.at[s].set(n, mode="drop"), 0, axis)

    return lowp_dots.write_as_bits(jax.vmap(write), ring, new_BT, slot_BT)


def ring_from_prefix(row, length, size: int, axis: int):
    """The `size`-slot ring of a one-row full cache `row` holding `length` positions (slots of
    positions before 0 hold position 0's entry, masked by the row's length)."""
    pos_R = jnp.maximum(ring_positions(jnp.reshape(length, (1,)), size)[0], 0)
    return jnp.take(row, pos_R, axis=axis + 1)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value caches and the number of valid entries per row.

    Sequence-major (`heads_major=False`): keys and values `[B, S, K, D]`, the layout the Pallas
    decode kernel reads. Heads-major (the default with XLA attention): keys `[B, K, D, S]`,
    values `[B, K, S, D]`, the layout XLA:CPU's attention dots read without copying the cache
    (`jaxrl.models.attention.cached_attention`; docs/design.md). `rings[i] > 0`: layer i keeps
    only its window, a ring of that many slots (S = rings[i]); empty: every layer keeps all.
    """

    k: list  # L arrays [B, S, K, D] (heads-major: [B, K, D, S])
    v: list  # L arrays [B, S, K, D] (heads-major: [B, K, S, D])
    lengths_B: jax.Array  # int32 [B]
    heads_major: bool = dataclasses.field(default=False, metadata=dict(static=True))
    rings: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    LOGICAL_AXES = ("cache_batch", "length", "kv_heads", "head_dim")  # sequence-major k and v
    HEADS_MAJOR_AXES = {"k": ("cache_batch", "kv_heads", "head_dim", "length"),
                        "v": ("cache_batch", "kv_heads", "length", "head_dim")}

    @staticmethod
    def logical_axes(which: str, heads_major: bool) -> tuple:
        """The logical axes of a layer's `which` ("k" or "v") array in the given layout."""
        return KVCache.HEADS_MAJOR_AXES[which] if heads_major else KVCache.LOGICAL_AXES

    @staticmethod
    def default_heads_major(cfg: ModelConfig) -> bool:
        """Heads-major unless decode attention runs the Pallas kernel (which reads [B, S, K, D])."""
        return resolve_impl(cfg.attention_impl) == "xla"

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, dtype=None,
             heads_major: bool | None = None, ring: bool = False) -> KVCache:
        """Zeros for `batch` rows of `max_len` positions; `heads_major=None` picks the layout
        for `cfg.attention_impl` (`default_heads_major`); `ring`: sliding layers keep only their
        window (`ring_sizes`)."""
        dtype = dtype or DTYPES[cfg.dtype]
        if heads_major is None:
            heads_major = cls.default_heads_major(cfg)
        k_, d = cfg.num_kv_heads, cfg.head_size

        def zeros(s):
            k_shape, v_shape = (((batch, k_, d, s), (batch, k_, s, d)) if heads_major
                                else ((batch, s, k_, d),) * 2)
            return jnp.zeros(k_shape, dtype), jnp.zeros(v_shape, dtype)

        layers = [zeros(s) for s in layer_lengths(cfg, max_len, ring)]
        return cls(k=[k for k, _ in layers], v=[v for _, v in layers],
                   lengths_B=jnp.zeros((batch,), jnp.int32), heads_major=heads_major,
                   rings=ring_sizes(cfg, max_len) if ring else ())

    def _seq_axis(self, which: str) -> int:
        """The sequence axis of a layer's `which` array, counted without the batch axis."""
        return (2 if which == "k" else 1) if self.heads_major else 0

    def ring_size(self, layer: int) -> int:
        """Layer `layer`'s ring slots, 0 when it keeps every position."""
        return self.rings[layer] if self.rings else 0

    @property
    def max_len(self) -> int | None:
        """Positions a row can hold: the full layers' length (None when every layer is a ring:
        a row can grow without end)."""
        full = [k.shape[self._seq_axis("k") + 1] for i, k in enumerate(self.k)
                if not self.ring_size(i)]
        return full[0] if full else None

    def write_and_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, positions_BT, kv_lengths_B,
                         impl: str, **options):
        """Write one layer's new entries at each row's length, then attend to that layer's cache
        (`options`: the layer's `window`, `softcap` and `scale`, `cached_attention`'s).

        Returns `(out_BTHD, layer_cache)`; `with_layers` assembles the new cache. Every
        cache layout (see `jaxrl.models.paged.PagedKVCache`) offers these two methods.
        """
        size = self.ring_size(layer)
        if size and q_BTHD.shape[1] > 1:
            return self._ring_attend_many(layer, q_BTHD, k_BTKD, v_BTKD, positions_BT, options)
        start_B = self.lengths_B % size if size else self.lengths_B
        if not size and self._cpu_kernel(q_BTHD, impl, options):  # write in place, attend
            d = q_BTHD.shape[-1]
            scale = d ** -0.5 if options.get("scale") is None else options["scale"]
            n_B = jnp.minimum(kv_lengths_B, positions_BT[:, 0] + 1)
            out_BHD, k_cache, v_cache = cpu_decode_attention.write_and_attend(
                q_BTHD[:, 0], k_BTKD[:, 0], v_BTKD[:, 0], self.k[layer], self.v[layer], start_B,
                n_B, scale)
            return out_BHD[:, None], (k_cache, v_cache)
        if self.heads_major:
            k_cache = _write_rows(self.k[layer], k_BTKD.transpose(0, 2, 3, 1), start_B, 2)
            v_cache = _write_rows(self.v[layer], v_BTKD.transpose(0, 2, 1, 3), start_B, 1)
        else:
            k_cache = _write_rows(self.k[layer], k_BTKD, start_B, 0)
            v_cache = _write_rows(self.v[layer], v_BTKD, start_B, 0)
        if size:  # the ring's valid slots are exactly the query's window
            kv_lengths_B, options = jnp.minimum(kv_lengths_B, size), {**options, "window": None}
        out_BTHD = cached_attention(q_BTHD, k_cache, v_cache, positions_BT, kv_lengths_B,
                                    impl=impl, heads_major=self.heads_major, **options)
        return out_BTHD, (k_cache, v_cache)

    def _cpu_kernel(self, q_BTHD, impl: str, options) -> bool:
        """A decode step of an engine on one CPU device (one token a row, heads-major, no window
        or softcap) on a layer that keeps every position: `jaxrl_kernels.cpu_decode_attention`
        when it is built (docs/design.md)."""
        return (q_BTHD.shape[1] == 1 and self.heads_major and lowp_dots.cpu_kernels()
                and resolve_impl(impl) == "xla"
                and options.get("window") is None and options.get("softcap") is None
                and cpu_decode_attention.supports(q_BTHD.shape[-1], self.k[0].dtype)
                and cpu_decode_attention.available())

    def _ring_attend_many(self, layer, q_BTHD, k_BTKD, v_BTKD, positions_BT, options):
        """T > 1 queries of a ring layer: attend to the ring's entries and the new ones by
        position; the ring is written in `with_layers`, which knows each row's valid tokens."""
        k_ring, v_ring = self.k[layer], self.v[layer]
        if self.heads_major:  # the sequence-major view [B, R, K, D]
            k_ring, v_ring = k_ring.transpose(0, 3, 1, 2), v_ring.transpose(0, 2, 1, 3)
        kpos_BS = jnp.concatenate(
            [ring_positions(self.lengths_B, self.ring_size(layer)), positions_BT], axis=1)
        out_BTHD = ring_attention(
            q_BTHD, jnp.concatenate([k_ring, k_BTKD.astype(k_ring.dtype)], axis=1),
            jnp.concatenate([v_ring, v_BTKD.astype(v_ring.dtype)], axis=1), positions_BT,
            kpos_BS, **options)
        return out_BTHD, (self.k[layer], self.v[layer], k_BTKD, v_BTKD)

    def with_layers(self, layers: list, lengths_B) -> KVCache:
        """The cache after a step: `layers` holds what `write_and_attend` returned per layer."""
        ks, vs = [], []
        for layer in layers:
            if len(layer) == 4:  # a ring layer after T > 1 tokens: write the valid ones
                k_ring, v_ring, k_BTKD, v_BTKD = layer
                if self.heads_major:
                    k_BTKD, v_BTKD = k_BTKD.transpose(0, 2, 3, 1), v_BTKD.transpose(0, 2, 1, 3)
                layer = (ring_write(k_ring, k_BTKD, self.lengths_B, lengths_B,
                                    self._seq_axis("k")),
                         ring_write(v_ring, v_BTKD, self.lengths_B, lengths_B,
                                    self._seq_axis("v")))
            ks.append(layer[0])
            vs.append(layer[1])
        return dataclasses.replace(self, k=ks, v=vs, lengths_B=lengths_B)

    def insert(self, slot, prefix: KVCache, length) -> KVCache:
        """Write a one-row full cache of the same layout (a prefilled prompt of `length` tokens)
        into row `slot`: a ring layer keeps the prefix's last positions, each in its slot."""
        def write(cache, row, layer, which):
            size = self.ring_size(layer)
            if size:
                row = ring_from_prefix(row, length, size, self._seq_axis(which))
            return jax.lax.dynamic_update_slice(cache, row.astype(cache.dtype),
                                                (slot,) + (0,) * (cache.ndim - 1))

        return dataclasses.replace(
            self, k=[write(c, p, i, "k") for i, (c, p) in enumerate(zip(self.k, prefix.k,
                                                                          strict=True))],
            v=[write(c, p, i, "v") for i, (c, p) in enumerate(zip(self.v, prefix.v, strict=True))],
            lengths_B=self.lengths_B.at[slot].set(length))


def _write_rows(cache, new, start_B, axis: int):
    """Write each row's T new entries at its own offset along the row's sequence `axis`."""
    if _select_one(cache, new, axis):  # where a slice would start: clamped to fit
        return _select_write(cache, new, jnp.clip(start_B, 0, cache.shape[axis + 1] - 1), axis)
    write = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=axis)
    return lowp_dots.write_as_bits(jax.vmap(write), cache, new.astype(cache.dtype), start_B)


def _select_one(cache, new, axis: int) -> bool:
    """A decode step's write (one entry per row) into a 2-byte float cache on CPU: a select
    over the cache. XLA:CPU runs a bf16 scatter on an f32 copy of its whole operand (converted
    and rounded back), and a scatter on the cache's bits (`lowp_dots.write_as_bits`) copies it
    twice (its bitcasts are copies there); a select passes over it once. bf16 decode at batch
    32: 1294 and 1315 tok/s against 1220 and 1215 with the bits scatter (docs/design.md)."""
    return (new.shape[axis + 1] == 1 and lowp_dots.active()
            and jnp.dtype(cache.dtype) in lowp_dots.LOW_PRECISION)


def _select_write(cache, new, slot_B, axis: int):
    """Each row's one new entry (`new`, size 1 along the row's `axis`) written at `slot_B` by a
    select over the cache; a slot out of range writes nothing."""
    size = cache.shape[axis + 1]
    shape = [1] * cache.ndim
    shape[0], shape[axis + 1] = cache.shape[0], size
    hit = (jnp.arange(size)[None, :] == slot_B[:, None]).reshape(shape)
    return jnp.where(hit, new.astype(cache.dtype), cache)
