"""decode_attention and paged_decode_attention (both bodies, interpret mode) against the jnp
references: ragged lengths including 1, GQA ratios 1/2/4/8, head dims 64/128, split-K."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from kernel_testing import TOLERANCES, assert_close

import jaxrl_kernels
from jaxrl_kernels.decode_attention import BlockSizes, decode_attention_reference
from jaxrl_kernels.paged_decode_attention import BlockSizes as PagedBlockSizes
from jaxrl_kernels.paged_decode_attention import paged_decode_attention_reference


def _poison_past_length(cache, lengths):
    """NaN at positions >= length: proves the kernels neither read nor mix in the invalid suffix."""
    pos = jnp.arange(cache.shape[1])[None, :, None, None]
    return jnp.where(pos < lengths[:, None, None, None], cache, jnp.nan)


def _qkv(B, S, Hq, Hkv, D, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, Hkv, D), jnp.float32).astype(dtype)
    return q, k, v


# (G, D, S, dtype, lengths, num_splits): rows of very different lengths, including 1; S not a
# multiple of block_k = 16; splits that leave some splits empty for short rows.
DECODE_CASES = [
    (1, 64, 40, "float32", [1, 40, 17], 1),
    (2, 128, 64, "bfloat16", [64, 1, 33], 2),
    (4, 64, 50, "float32", [1, 50, 7, 29], 3),
    (8, 128, 32, "bfloat16", [1, 32], None),
]


@pytest.mark.parametrize("G,D,S,dtype,lengths,splits", DECODE_CASES)
def test_decode_matches_reference(interpret, G, D, S, dtype, lengths, splits):
    Hkv = 2
    lengths = jnp.asarray(lengths, jnp.int32)
    q, k, v = _qkv(len(lengths), S, G * Hkv, Hkv, D, jnp.dtype(dtype))
    out = jaxrl_kernels.decode_attention(
        q,
        _poison_past_length(k, lengths),
        _poison_past_length(v, lengths),
        lengths,
        block_sizes=BlockSizes(block_k=16, num_splits=splits),
        interpret=interpret,
    )
    ref = decode_attention_reference(q, k, v, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype, TOLERANCES)


def _paged(k, v, lengths, page_size, num_pages, seed=0):
    """Scatter contiguous caches into a shuffled page pool; table entries past the length point
    out of the pool (they must never be read) and unused pool pages are NaN."""
    B, S, Hkv, D = k.shape
    P = S // page_size
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_pages)[: B * P].reshape(B, P)
    used = np.arange(P)[None, :] < -(-np.asarray(lengths)[:, None] // page_size)
    table = np.where(used, table, num_pages + 1000)
    pools = []
    for cache in (k, v):
        pool = jnp.full((num_pages, page_size, Hkv, D), jnp.nan, cache.dtype)
        pages = _poison_past_length(cache, lengths).reshape(B * P, page_size, Hkv, D)
        idx = table.reshape(-1)
        keep = idx < num_pages
        pools.append(pool.at[idx[keep]].set(pages[keep]))
    return pools[0], pools[1], jnp.asarray(table, jnp.int32)


# (G, D, dtype, lengths, page_size, pages_per_seq, num_splits)
PAGED_CASES = [
    (1, 64, "float32", [1, 64, 23], 16, 4, 1),
    (4, 128, "bfloat16", [48, 1], 16, 3, 2),
    (8, 64, "float32", [17, 1, 32], 16, 2, None),
]


@pytest.mark.parametrize("G,D,dtype,lengths,page_size,P,splits", PAGED_CASES)
def test_paged_decode_matches_reference(interpret, G, D, dtype, lengths, page_size, P, splits):
    Hkv = 2
    lengths = jnp.asarray(lengths, jnp.int32)
    B = len(lengths)
    q, k, v = _qkv(B, P * page_size, G * Hkv, Hkv, D, jnp.dtype(dtype), seed=3)
    k_pages, v_pages, table = _paged(k, v, lengths, page_size, num_pages=B * P + 3)
    out = jaxrl_kernels.paged_decode_attention(
        q,
        k_pages,
        v_pages,
        lengths,
        table,
        block_sizes=PagedBlockSizes(num_splits=splits),
        interpret=interpret,
    )
    ref = decode_attention_reference(q, k, v, lengths)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype, TOLERANCES)


def test_paged_reference_equals_contiguous_reference():
    lengths = jnp.asarray([5, 32], jnp.int32)
    q, k, v = _qkv(2, 32, 4, 2, 16, jnp.float32)
    table = jnp.asarray([[3, 0], [1, 2]], jnp.int32)
    pool_k = jnp.zeros((4, 16, 2, 16)).at[table.reshape(-1)].set(k.reshape(4, 16, 2, 16))
    pool_v = jnp.zeros((4, 16, 2, 16)).at[table.reshape(-1)].set(v.reshape(4, 16, 2, 16))
    np.testing.assert_allclose(
        paged_decode_attention_reference(q, pool_k, pool_v, lengths, table),
        decode_attention_reference(q, k, v, lengths),
        atol=1e-6,
    )


def test_zero_length_rows_give_zeros():
    lengths = jnp.asarray([0, 3], jnp.int32)
    q, k, v = _qkv(2, 16, 2, 1, 16, jnp.float32)
    out = jaxrl_kernels.decode_attention(q, k, v, lengths, interpret=True)
    np.testing.assert_array_equal(np.asarray(out[0]), 0.0)
    assert_close(out[1], decode_attention_reference(q, k, v, lengths)[1], "float32")
