"""decode_attention and paged_decode_attention (both bodies, interpret mode) against the jnp
references: ragged lengths including 1, GQA ratios 1/2/4/8, head dims 64/128, split-K."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import (
    TOLERANCES,
    assert_close,
    attention_f64,
    pallas_grids,
    sliding_window_visible,
)

import jaxrl_kernels
from jaxrl_kernels.decode_attention import BlockSizes, decode_attention_reference
from jaxrl_kernels.paged_decode_attention import BlockSizes as PagedBlockSizes
from jaxrl_kernels.paged_decode_attention import paged_decode_attention_reference


def _poison_past_length(cache, lengths, window=None):
    """NaN at positions >= length (and, with a window, < length - window): proves the kernels
    neither read nor mix in the positions a row must not see."""
    pos = jnp.arange(cache.shape[1])[None, :, None, None]
    ok = pos < lengths[:, None, None, None]
    if window is not None:
        ok = ok & (pos >= lengths[:, None, None, None] - window)
    return jnp.where(ok, cache, jnp.nan)


def _window_f64(q, k, v, lengths, window, softcap=None):
    """Float64 decode with a sliding window (and a soft cap): the query sits at position
    length - 1."""
    visible = sliding_window_visible(
        np.asarray(lengths)[:, None] - 1, np.arange(k.shape[1]), window
    )
    return attention_f64(q[:, None], k, v, visible, softcap=softcap)[:, 0]


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


def _paged(k, v, lengths, page_size, num_pages, seed=0, window=None):
    """Scatter contiguous caches into a shuffled page pool; table entries past the length (and,
    with a window, before the page holding length - window) point out of the pool (they must
    never be read) and unused pool pages are NaN."""
    B, S, Hkv, D = k.shape
    P = S // page_size
    rng = np.random.default_rng(seed)
    table = rng.permutation(num_pages)[: B * P].reshape(B, P)
    n = np.asarray(lengths)[:, None]
    used = np.arange(P)[None, :] < -(-n // page_size)
    if window is not None:
        used = used & (np.arange(P)[None, :] >= np.maximum(n - window, 0) // page_size)
    table = np.where(used, table, num_pages + 1000)
    pools = []
    for cache in (k, v):
        pool = jnp.full((num_pages, page_size, Hkv, D), jnp.nan, cache.dtype)
        pages = _poison_past_length(cache, lengths, window).reshape(B * P, page_size, Hkv, D)
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


# Sliding windows and soft caps. (G, Hkv, S, lengths, window, num_splits, softcap): S not a
# multiple of block_k = 16, windows that are not multiples of it, rows shorter and longer than the
# window (and 1), GQA; soft caps (scores -> cap * tanh(scores / cap)) with and without a window.
# Positions a row must not see (before its window, past its length) are NaN.
DECODE_WINDOW_CASES = [
    (2, 2, 70, [70, 1, 9, 40], 7, 2, None),
    (4, 1, 50, [50, 17, 33], 20, None, None),
    (3, 2, 45, [45, 2, 30], 1, 3, None),  # window 1: only the token itself
    (2, 2, 70, [70, 1, 9, 40], 7, 2, 1.5),
    (3, 2, 45, [45, 2, 30], None, 3, 1.0),  # a cap alone, G = 3
]


@pytest.mark.parametrize("G,Hkv,S,lengths,window,splits,softcap", DECODE_WINDOW_CASES)
def test_decode_window_matches_float64(interpret, G, Hkv, S, lengths, window, splits, softcap):
    lengths = jnp.asarray(lengths, jnp.int32)
    q, k, v = _qkv(len(lengths), S, G * Hkv, Hkv, 32, jnp.float32, seed=11)
    out = jaxrl_kernels.decode_attention(
        q,
        _poison_past_length(k, lengths, window),
        _poison_past_length(v, lengths, window),
        lengths,
        window=window,
        softcap=softcap,
        block_sizes=BlockSizes(block_k=16, num_splits=splits),
        interpret=interpret,
    )
    want = _window_f64(q, k, v, lengths, window, softcap)
    assert_close(out, want, "float32", TOLERANCES)
    ref = decode_attention_reference(q, k, v, lengths, window=window, softcap=softcap)
    assert_close(ref, want, "float32", TOLERANCES)
    if softcap is not None:  # the cap matters on these inputs
        assert np.abs(_window_f64(q, k, v, lengths, window) - want).max() > 0.05
    if window == 1:  # each row sees its last token alone: the output is that token's value
        last = v[jnp.arange(len(lengths)), lengths - 1]  # [B, Hkv, D]
        np.testing.assert_allclose(out, jnp.repeat(last, G, axis=1), atol=1e-6, rtol=0)


def test_decode_window_at_least_length_is_no_window(interpret):
    lengths = jnp.asarray([40, 3, 25], jnp.int32)
    q, k, v = _qkv(3, 40, 4, 2, 32, jnp.float32, seed=12)
    bs = BlockSizes(block_k=16, num_splits=2)
    plain = jaxrl_kernels.decode_attention(q, k, v, lengths, block_sizes=bs, interpret=interpret)
    for window in (40, 57):
        out = jaxrl_kernels.decode_attention(
            q, k, v, lengths, window=window, block_sizes=bs, interpret=interpret
        )
        np.testing.assert_allclose(out, plain, atol=1e-6, rtol=0)


def test_decode_window_rejects_bad_values():
    lengths = jnp.asarray([3], jnp.int32)
    q, k, v = _qkv(1, 16, 2, 1, 16, jnp.float32)
    with pytest.raises(ValueError, match="window must be a positive int or None, got -3"):
        jaxrl_kernels.decode_attention(q, k, v, lengths, window=-3, interpret=True)
    with pytest.raises(ValueError, match="softcap must be a positive finite number or None"):
        jaxrl_kernels.decode_attention(q, k, v, lengths, softcap=-1.0, interpret=True)


def test_decode_window_tpu_grid_spans_only_the_window():
    """The TPU grid walks the blocks (pages) a window can touch, not the whole cache: 40 positions
    touch at most 4 blocks of 16, so 2 splits take 2 steps each instead of 16 (of 512 / 16)."""
    q, k, _ = _qkv(2, 512, 4, 2, 32, jnp.float32)
    lengths = jnp.asarray([512, 100], jnp.int32)
    tpu = dict(backend="tpu", interpret=pltpu.InterpretParams())
    bs = BlockSizes(block_k=16, num_splits=2)
    for window, steps in ((None, 16), (40, 2)):
        run = lambda q, k, n, w=window: jaxrl_kernels.decode_attention(
            q, k, k, n, window=w, block_sizes=bs, **tpu
        )
        assert pallas_grids(run, q, k, lengths) == [(2, 2, steps)]
    pages = k.reshape(64, 16, 2, 32)
    table = jnp.arange(64, dtype=jnp.int32).reshape(2, 32)
    for window, steps in ((None, 16), (40, 2)):
        run = lambda q, p, n, t, w=window: jaxrl_kernels.paged_decode_attention(
            q, p, p, n, t, window=w, block_sizes=PagedBlockSizes(num_splits=2), **tpu
        )
        assert pallas_grids(run, q, pages, lengths, table) == [(2, 2, steps)]


# (G, lengths, window, page_size, pages_per_seq, num_splits, softcap): windows not multiples of
# the page, rows shorter and longer than the window (and 1); table entries before the window's
# first page point out of the pool, so the TPU interpreter raises if a body reads them.
PAGED_WINDOW_CASES = [
    (2, [80, 1, 30, 47], 21, 16, 5, 2, None),
    (4, [64, 9, 33], 1, 16, 4, None, None),
    (2, [80, 1, 30, 47], 21, 16, 5, 2, 1.5),
    (3, [64, 9, 33], None, 16, 4, 3, 1.0),  # a cap alone, G = 3
]


@pytest.mark.parametrize("G,lengths,window,page_size,P,splits,softcap", PAGED_WINDOW_CASES)
def test_paged_decode_window_matches_float64(
    interpret, G, lengths, window, page_size, P, splits, softcap
):
    Hkv = 2
    lengths = jnp.asarray(lengths, jnp.int32)
    B = len(lengths)
    q, k, v = _qkv(B, P * page_size, G * Hkv, Hkv, 32, jnp.float32, seed=13)
    k_pages, v_pages, table = _paged(k, v, lengths, page_size, B * P + 3, window=window)
    out = jaxrl_kernels.paged_decode_attention(
        q,
        k_pages,
        v_pages,
        lengths,
        table,
        window=window,
        softcap=softcap,
        block_sizes=PagedBlockSizes(num_splits=splits),
        interpret=interpret,
    )
    want = _window_f64(q, k, v, lengths, window, softcap)
    assert_close(out, want, "float32", TOLERANCES)
    # The reference reads every page it is given: hand it a clean pool, pages in order.
    table = jnp.arange(B * P, dtype=jnp.int32).reshape(B, P)
    pool_k, pool_v = (x.reshape(B * P, page_size, Hkv, -1) for x in (k, v))
    ref = paged_decode_attention_reference(
        q, pool_k, pool_v, lengths, table, window=window, softcap=softcap
    )
    assert_close(ref, want, "float32", TOLERANCES)
    if softcap is not None:  # the cap matters on these inputs
        assert np.abs(_window_f64(q, k, v, lengths, window) - want).max() > 0.05
