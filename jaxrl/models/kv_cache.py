"""The contiguous KV cache of generation: per-layer keys and values and each row's length.

Sliding-window layers keep their whole cache here; the window is a mask
(`jaxrl.models.attention.cached_attention`).
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp

from jaxrl.config import ModelConfig
from jaxrl.models.attention import cached_attention, resolve_impl

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16, "float16": jnp.float16}


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class KVCache:
    """Per-layer key/value caches and the number of valid entries per row.

    Sequence-major (`heads_major=False`): keys and values `[B, S, K, D]`, the layout the Pallas
    decode kernel reads. Heads-major (the default with XLA attention): keys `[B, K, D, S]`,
    values `[B, K, S, D]`, the layout XLA:CPU's attention dots read without copying the cache
    (`jaxrl.models.attention.cached_attention`; docs/design.md).
    """

    k: list  # L arrays [B, S, K, D] (heads-major: [B, K, D, S])
    v: list  # L arrays [B, S, K, D] (heads-major: [B, K, S, D])
    lengths_B: jax.Array  # int32 [B]
    heads_major: bool = dataclasses.field(default=False, metadata=dict(static=True))

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
             heads_major: bool | None = None) -> KVCache:
        """Zeros for `batch` rows of `max_len` positions; `heads_major=None` picks the layout
        for `cfg.attention_impl` (`default_heads_major`)."""
        dtype = dtype or DTYPES[cfg.dtype]
        if heads_major is None:
            heads_major = cls.default_heads_major(cfg)
        k_, d = cfg.num_kv_heads, cfg.head_size
        k_shape, v_shape = (((batch, k_, d, max_len), (batch, k_, max_len, d)) if heads_major
                            else ((batch, max_len, k_, d),) * 2)
        return cls(k=[jnp.zeros(k_shape, dtype) for _ in range(cfg.num_layers)],
                   v=[jnp.zeros(v_shape, dtype) for _ in range(cfg.num_layers)],
                   lengths_B=jnp.zeros((batch,), jnp.int32), heads_major=heads_major)

    @property
    def max_len(self) -> int:
        return self.k[0].shape[-1 if self.heads_major else 1]

    def write_and_attend(self, layer: int, q_BTHD, k_BTKD, v_BTKD, positions_BT, kv_lengths_B,
                         impl: str, **options):
        """Write one layer's new entries at each row's length, then attend to that layer's cache
        (`options`: the layer's `window`, `softcap` and `scale`, `cached_attention`'s).

        Returns `(out_BTHD, (k_cache, v_cache))`; `with_layers` assembles the new cache. Every
        cache layout (see `jaxrl.models.paged.PagedKVCache`) offers these two methods.
        """
        if self.heads_major:
            k_cache = _write_rows(self.k[layer], k_BTKD.transpose(0, 2, 3, 1), self.lengths_B, 2)
            v_cache = _write_rows(self.v[layer], v_BTKD.transpose(0, 2, 1, 3), self.lengths_B, 1)
        else:
            k_cache = _write_rows(self.k[layer], k_BTKD, self.lengths_B, 0)
            v_cache = _write_rows(self.v[layer], v_BTKD, self.lengths_B, 0)
        out_BTHD = cached_attention(q_BTHD, k_cache, v_cache, positions_BT, kv_lengths_B,
                                    impl=impl, heads_major=self.heads_major, **options)
        return out_BTHD, (k_cache, v_cache)

    def with_layers(self, layers: list, lengths_B) -> KVCache:
        """The cache after a step: `layers` holds what `write_and_attend` returned per layer."""
        return KVCache(k=[k for k, _ in layers], v=[v for _, v in layers], lengths_B=lengths_B,
                       heads_major=self.heads_major)


def _write_rows(cache, new, start_B, axis: int):
    """Write each row's T new entries at its own offset along the row's sequence `axis`."""
    write = lambda c, n, s: jax.lax.dynamic_update_slice_in_dim(c, n, s, axis=axis)
    return jax.vmap(write)(cache, new.astype(cache.dtype), start_B)
