"""The XLA self-attention path (one query block at a time) against one full T x T masked product.

The reference is written out here from the definition (softmax over keys at or before the query
in the same segment), independent of the blocking; tolerances are f32 rounding (1e-5).
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.attention import attention, query_blocks


def dense_reference(q, k, v, seg):
    b, t, hq, d = q.shape
    g = hq // k.shape[2]
    k_rep, v_rep = jnp.repeat(k, g, axis=2), jnp.repeat(v, g, axis=2)
    s = jnp.einsum("bthd,bshd->bhts", q, k_rep) / np.sqrt(d)
    ok = (np.arange(t)[:, None] >= np.arange(t)[None, :])[None] & (
        seg[:, :, None] == seg[:, None, :]
    )
    s = jnp.where(ok[:, None], s, -jnp.inf)
    return jnp.einsum("bhts,bshd->bthd", jax.nn.softmax(s, axis=-1), v_rep)


def test_query_blocks_cover_the_sequence_once():
    for t in (1, 63, 64, 200, 512, 8192, 8191):
        blocks = query_blocks(t)
        assert blocks[0][0] == 0 and blocks[-1][1] == t
        assert all(a[1] == b[0] for a, b in zip(blocks, blocks[1:], strict=False))
        assert len(blocks) <= 16 and all(e - i >= min(64, t) or e == t for i, e in blocks)
    assert query_blocks(512) == [(i, i + 64) for i in range(0, 512, 64)]


@pytest.mark.parametrize("t,hq,hkv", [(200, 4, 2), (130, 8, 1), (64, 2, 2), (37, 4, 4)])
def test_blocked_equals_dense_with_segments_and_padding(t, hq, hkv):
    rng = np.random.default_rng(t)
    b, d = 2, 16
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    k = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    v = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    seg = np.ones((b, t), np.int32)
    seg[0, t // 3 :] = 2  # two packed segments, the second crossing block edges
    seg[1, t - t // 4 :] = 0  # trailing padding
    seg = jnp.asarray(seg)
    out = attention(q, k, v, segment_ids_BT=seg, impl="xla")
    np.testing.assert_allclose(out, dense_reference(q, k, v, seg), atol=1e-5, rtol=1e-5)

    def loss(fn):
        return lambda q, k, v: jnp.sum(jnp.sin(fn(q, k, v)))

    got = jax.grad(loss(lambda q, k, v: attention(q, k, v, segment_ids_BT=seg)), (0, 1, 2))(q, k, v)
    want = jax.grad(loss(lambda q, k, v: dense_reference(q, k, v, seg)), (0, 1, 2))(q, k, v)
    for g_, w_ in zip(got, want, strict=True):
        np.testing.assert_allclose(g_, w_, atol=1e-5, rtol=1e-4)


def test_self_attention_rejects_a_cache_shaped_call():
    q = jnp.zeros((1, 4, 2, 8))
    kv = jnp.zeros((1, 6, 2, 8))
    with pytest.raises(ValueError, match="T=4, S=6"):
        attention(q, kv, kv)
