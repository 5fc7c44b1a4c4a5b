"""A paged KV cache for the generator: per-layer page pools, a page table per slot, lengths.

Layout (per layer): keys and values live in a pool of `num_pages` pages `[N, page_size, K, D]`.
Row (slot) b's logical page i — positions `[i * page_size, (i + 1) * page_size)` — is the
physical page `page_table_BP[b, i]`. Decode attention reads pages through the table
(`jaxrl_kernels.paged_decode_attention` with `attention_impl="pallas"`); the XLA path gathers a
row's pages into a contiguous `[B, P * page_size, K, D]` view and runs the model's
`cached_attention`.

Allocation is static: slot b owns pages `[b * P, (b + 1) * P)` for good, with
`P = ceil(max_len / page_size)` pages per slot, so a slot can always grow to `max_len` and nothing
is allocated or freed while decoding. This is the simplest correct scheme; it saves no memory over
the contiguous cache (it uses `slots * P * page_size >= slots * max_len` entries). Every read and
write goes through the page table, so a free-list allocator that hands out fewer pages can later
replace `static_page_table` without touching attention.

Windowed pages (`ring=True`, what the generation engine makes): a sliding layer whose window
spans fewer pages than a slot keeps only `ceil(window / page_size)` pages per slot, a ring of
`R` positions (position p at ring index `p % R`) in its own pool, read through `ring_table_BP`.
With `R == window` the ring's valid slots are exactly a decode query's window and the paged
kernel reads them as a prefix (no window); otherwise (a window that is not a multiple of the
page size) and for T > 1 queries the ring is gathered and masked by the positions its slots hold
(`jaxrl.models.kv_cache.ring_attention`), on the XLA path also under `attention_impl="pallas"`
(the kernel assumes slot i holds position i).

A cache offers `write_and_attend` and `with_layers`, the two methods the model's layer loop
(`Transformer.decode_hidden`) calls; `insert` writes a prefilled prompt into a slot.

Shape suffixes as in `jaxrl.models.transformer`; N pages, P pages per slot, S positions.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec

import jaxrl_kernels
from jaxrl.config import ModelConfig
from jaxrl.models.attention import cached_attention, kernel_shard_axes, resolve_impl
from jaxrl.models.kv_cache import (
    ring_attention,
    ring_from_prefix,
    ring_positions,
    ring_sizes,
    ring_slots,
)
from jaxrl.models.transformer import DTYPES, KVCache


def pages_per_slot(max_len: int, page_size: int) -> int:
    """Pages a slot needs to hold `max_len` positions."""
    return -(-max_len // page_size)


def static_page_table(num_slots: int, pages_per_seq: int):
    """Slot b owns physical pages `[b * P, (b + 1) * P)`: int32 `[num_slots, P]`."""
    return jnp.arange(num_slots * pages_per_seq, dtype=jnp.int32).reshape(num_slots, pages_per_seq)


def gather_pages(pages_NSKD, page_table_BP):
    """A contiguous view `[B, P * page_size, K, D]` of each row's pages, in logical order."""
    b, p = page_table_BP.shape
    _, page_size, k, d = pages_NSKD.shape
    return pages_NSKD[page_table_BP].reshape(b, p * page_size, k, d)


def write_pages(pages_NSKD, new_BTKD, page_table_BP, positions_BT):
    """Write row b's T new entries at `positions_BT[b]` into its pages.

    Positions past the row's last page (padding beyond the table) are dropped, never written
    into another row's page.
    """
    n, page_size, k, d = pages_NSKD.shape
    p = page_table_BP.shape[1]
    logical_BT = positions_BT // page_size
    page_BT = jnp.take_along_axis(page_table_BP, jnp.minimum(logical_BT, p - 1), axis=1)
    flat_BT = jnp.where(logical_BT < p, page_BT * page_size + positions_BT % page_size,
                        n * page_size)  # out of range: dropped
    flat_XKD = pages_NSKD.reshape(n * page_size, k, d)
    flat_XKD = flat_XKD.at[flat_BT.reshape(-1)].set(
        new_BTKD.reshape(-1, k, d).astype(pages_NSKD.dtype), mode="drop")
    return flat_XKD.reshape(n, page_size, k, d)


def paged_attention(q_BTHD, k_pages, v_pages, page_table_BP, q_positions_BT, kv_lengths_B, *,
                    impl: str = "xla", window: int | None = None, softcap: float | None = None,
                    scale: float | None = None):
    """Queries at `q_positions` attend to each row's first `kv_lengths` entries (causally).

    One query per row with impl "pallas" (or "auto" on TPU/GPU) runs
    `jaxrl_kernels.paged_decode_attention`, which reads only the pages holding valid tokens (on CPU
    it runs in Pallas' interpreter, as `cached_attention`'s kernels do). Anything else (XLA / cuDNN
    settings, or T > 1 queries such as chunked prefill) gathers the pages into a contiguous view
    and uses the XLA `cached_attention`. The kernel takes the `window` (reading only the pages it
    touches), the `softcap` and the `scale`.
    """
    if resolve_impl(impl) == "pallas" and q_BTHD.shape[1] == 1:
        return _pallas_paged_decode(q_BTHD[:, 0], k_pages, v_pages, kv_lengths_B,
                                    page_table_BP, scale, window, softcap)[:, None]
    k_BSKD = gather_pages(k_pages, page_table_BP)
    v_BSKD = gather_pages(v_pages, page_table_BP)
    return cached_attention(q_BTHD, k_BSKD, v_BSKD, q_positions_BT, kv_lengths_B, impl="xla",
                            window=window, softcap=softcap, scale=scale)


def _pallas_paged_decode(q_BHD, k_pages, v_pages, kv_lengths_B, page_table_BP, scale=None,
                         window=None, softcap=None):
    """`jaxrl_kernels.paged_decode_attention`, per shard when the mesh in context (`jax.set_mesh`)
    splits slots or kv heads, as `jaxrl.models.attention` runs the other kernels.

    Per shard, the pool is the shard's slice of pages and the table is made local by subtracting
    the shard's first page. That needs each row's pages to lie in the row's own shard, which the
    static allocation guarantees (slot b's pages follow slot b). check_vma=False for the reason
    given in `attention._pallas_flash` (scalar-prefetch operands under Pallas' CPU interpreter).
    """
    paged = functools.partial(jaxrl_kernels.paged_decode_attention, sm_scale=scale,
                              window=window, softcap=softcap)
    sharded = kernel_shard_axes(q_BHD.shape[0], k_pages.shape[2])
    if sharded is None:
        return paged(q_BHD, k_pages, v_pages, kv_lengths_B, page_table_BP)

    mesh, b, h = sharded

    def body(q, k, v, lengths, table):
        if b is not None:  # physical page ids -> this shard's slice of the pool
            table = table - jax.lax.axis_index(b) * k.shape[0]
        return paged(q, k, v, lengths, table)

    pages = PartitionSpec(b, None, h, None)
    fn = jax.shard_map(
        body, mesh=mesh,
        in_specs=(PartitionSpec(b, h, None), pages, pages, PartitionSpec(b),
                  PartitionSpec(b, None)),
        out_specs=PartitionSpec(b, h, None), check_vma=False,
    )
    return fn(q_BHD, k_pages, v_pages, kv_lengths_B, page_table_BP)


def ring_page_counts(cfg: ModelConfig, max_len: int, page_size: int) -> tuple[int, ...]:
    """Per layer, the pages per slot of a sliding layer's ring (fewer than a full slot's), or 0
    for a layer that keeps a full slot (`pages_per_slot(max_len, page_size)` pages)."""
    full = pages_per_slot(max_len, page_size)
    counts = (pages_per_slot(w, page_size) if w else 0 for w in ring_sizes(cfg, max_len))
    return tuple(c if c < full else 0 for c in counts)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class PagedKVCache:
    """Per-layer key/value page pools, the page tables and the number of valid entries per row.

    `rings[i] > 0`: layer i keeps a ring of that many positions (whole pages) per slot in its
    pool, read through `ring_table_BP` (None when no layer does).
    """

    k_pages: list  # L arrays [N, page_size, K, D] (a ring layer: [B * Pw, page_size, K, D])
    v_pages: list
    page_table_BP: jax.Array  # int32 [B, P]: physical page of each row's logical page
    lengths_B: jax.Array  # int32 [B]
    ring_table_BP: jax.Array | None = None  # int32 [B, Pw]: the ring layers' pages
    rings: tuple = dataclasses.field(default=(), metadata=dict(static=True))

    # Pages over `dp` like slots: with static allocation slot b's pages sit in slot b's shard.
    LOGICAL_AXES = ("cache_batch", None, "kv_heads", "head_dim")

    @classmethod
    def init(cls, cfg: ModelConfig, batch: int, max_len: int, page_size: int,
             dtype=None, ring: bool = False) -> PagedKVCache:
        """Empty cache for `batch` slots of up to `max_len` positions (static allocation);
        `ring`: sliding layers keep only the pages their window spans (`ring_page_counts`)."""
        if page_size < 1:
            raise ValueError(f"PagedKVCache: page_size must be >= 1, got {page_size}")
        dtype = dtype or DTYPES[cfg.dtype]
        p = pages_per_slot(max_len, page_size)
        counts = ring_page_counts(cfg, max_len, page_size) if ring else (0,) * cfg.num_layers
        shape = lambda c: ((batch * (c or p)), page_size, cfg.num_kv_heads, cfg.head_size)
        ring_pages = max(counts)
        return cls(k_pages=[jnp.zeros(shape(c), dtype) for c in counts],
                   v_pages=[jnp.zeros(shape(c), dtype) for c in counts],
                   page_table_BP=static_page_table(batch, p),
                   lengths_B=jnp.zeros((batch,), jnp.int32),
                   ring_table_BP=static_page_table(batch, ring_pages) if ring_pages else None,
                   rings=tuple(c * page_size for c in counts) if ring_pages else ())

    @property
    def page_size(self) -> int:
        return self.k_pages[0].shape[1]

    @property
    def max_len(self) -> int:
        """Positions a row can hold: pages per row x page size."""
        return self.page_table_BP.shape[1] * self.page_size

    def ring_size(self, layer: int) -> int:
        """Layer `layer`'s ring positions per slot, 0 when it keeps a full slot."""
        return self.rings[layer] if self.rings else 0

    def write_and_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, positions_BT, kv_lengths_B,
                         impl: str, **options):
        """Write one layer's new entries at `positions_BT` through the page table, then attend.

        Returns `(out_BTHD, layer_cache)` (see `KVCache.write_and_attend`; `options`:
        the layer's `window`, `softcap` and `scale`).
        """
        size = self.ring_size(layer)
        if size:
            return self._ring_write_and_attend(layer, q_BTHD, k_BTKD, v_BTKD, positions_BT,
                                               kv_lengths_B, impl, options)
        k_pages = write_pages(self.k_pages[layer], k_BTKD, self.page_table_BP, positions_BT)
        v_pages = write_pages(self.v_pages[layer], v_BTKD, self.page_table_BP, positions_BT)
        out_BTHD = paged_attention(q_BTHD, k_pages, v_pages, self.page_table_BP, positions_BT,
                                   kv_lengths_B, impl=impl, **options)
        return out_BTHD, (k_pages, v_pages)

    def _ring_write_and_attend(self, layer, q_BTHD, k_BTKD, v_BTKD, positions_BT, kv_lengths_B,
                               impl, options):
        """A ring layer: one query writes its entry, then attends to the ring (the paged kernel
        when the ring is exactly the window); T > 1 queries attend to the ring's entries and the
        new ones by position, and `with_layers` writes the valid ones."""
        size, table = self.ring_size(layer), self.ring_table_BP
        k_pages, v_pages = self.k_pages[layer], self.v_pages[layer]
        if q_BTHD.shape[1] > 1:
            k_ring, v_ring = gather_pages(k_pages, table), gather_pages(v_pages, table)
            kpos_BS = jnp.concatenate([ring_positions(self.lengths_B, size), positions_BT], 1)
            out_BTHD = ring_attention(
                q_BTHD, jnp.concatenate([k_ring, k_BTKD.astype(k_ring.dtype)], axis=1),
                jnp.concatenate([v_ring, v_BTKD.astype(v_ring.dtype)], axis=1), positions_BT,
                kpos_BS, **options)
            return out_BTHD, (k_pages, v_pages, k_BTKD, v_BTKD)
        k_pages = write_pages(k_pages, k_BTKD, table, positions_BT % size)
        v_pages = write_pages(v_pages, v_BTKD, table, positions_BT % size)
        if resolve_impl(impl) == "pallas" and options.get("window") == size:  # slots = window
            out_BTHD = paged_attention(q_BTHD, k_pages, v_pages, table, positions_BT,
                                       jnp.minimum(kv_lengths_B, size), impl=impl,
                                       **{**options, "window": None})
        else:
            out_BTHD = ring_attention(q_BTHD, gather_pages(k_pages, table),
                                      gather_pages(v_pages, table), positions_BT,
                                      ring_positions(kv_lengths_B, size), **options)
        return out_BTHD, (k_pages, v_pages)

    def with_layers(self, layers: list, lengths_B) -> PagedKVCache:
        """The cache after a step: `layers` holds what `write_and_attend` returned per layer."""
        ks, vs = [], []
        for i, layer in enumerate(layers):
            if len(layer) == 4:  # a ring layer after T > 1 tokens: write the valid ones
                k_pages, v_pages, k_BTKD, v_BTKD = layer
                slots_BT = ring_slots(self.lengths_B, lengths_B, k_BTKD.shape[1],
                                       self.ring_size(i))
                layer = (write_pages(k_pages, k_BTKD, self.ring_table_BP, slots_BT),
                         write_pages(v_pages, v_BTKD, self.ring_table_BP, slots_BT))
            ks.append(layer[0])
            vs.append(layer[1])
        return dataclasses.replace(self, k_pages=ks, v_pages=vs, lengths_B=lengths_B)

    def insert(self, slot, prefix: KVCache, length) -> PagedKVCache:
        """Write a one-row contiguous prefix cache (a prefilled prompt) into `slot`'s pages.

        All of the prefix's positions are written (those past `length` are padding, masked by
        the row's length and overwritten by later tokens); a ring layer keeps the last positions
        before `length`, each in its ring slot. The row's length becomes `length`.
        """
        s = prefix.k[0].shape[1]
        if s > self.max_len:
            raise ValueError(f"PagedKVCache.insert: prefix of {s} positions exceeds the "
                             f"{self.max_len} a slot holds")
        row_of = lambda table: jax.lax.dynamic_slice_in_dim(table, slot, 1, axis=0)

        def write(pages, row, layer):
            size = self.ring_size(layer)
            if size:
                row, table_1P = ring_from_prefix(row, length, size, 0), row_of(self.ring_table_BP)
            else:
                table_1P = row_of(self.page_table_BP)
            positions_1S = jnp.arange(row.shape[1], dtype=jnp.int32)[None]
            return write_pages(pages, row, table_1P, positions_1S)

        each = lambda pools, rows: [write(pages, row, i) for i, (pages, row)
                                    in enumerate(zip(pools, rows, strict=True))]
        return dataclasses.replace(
            self, k_pages=each(self.k_pages, prefix.k), v_pages=each(self.v_pages, prefix.v),
            lengths_B=self.lengths_B.at[slot].set(length))

