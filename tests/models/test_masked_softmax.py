"""The attention softmax with a hand-written backward: equal to autodiff of the plain expression,
and it leaves one f32 array per query block for the backward pass instead of three (issue 22:
the RL train step's memory)."""

import contextlib
import io

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import print_saved_residuals

from jaxrl.models.attention import attention, masked_softmax, query_blocks


def _plain(scores, mask):
    return jax.nn.softmax(jnp.where(mask, scores, -1e30), axis=-1)


def test_value_and_gradient_equal_autodiff_with_a_fully_masked_row():
    k = jax.random.split(jax.random.key(0), 2)
    scores = jax.random.normal(k[0], (2, 3, 5, 7)) * 3
    cot = jax.random.normal(k[1], (2, 3, 5, 7))
    mask = np.tril(np.ones((5, 7), bool), 2)[None, None] & np.ones((2, 3, 1, 1), bool)
    mask[1, 2, 4] = False  # a row that sees no key (padding): uniform, as before
    np.testing.assert_allclose(masked_softmax(scores, mask), _plain(scores, mask), atol=1e-7)
    got = jax.vjp(lambda s: masked_softmax(s, mask), scores)[1](cot)[0]
    want = jax.vjp(lambda s: _plain(s, mask), scores)[1](cot)[0]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
    assert np.all(np.asarray(got)[np.broadcast_to(~mask, got.shape) & (mask.any(-1)[..., None])]
                  == 0)  # masked keys of a row that sees some key get no gradient


def _residual_shapes(fn, *args) -> list[str]:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        print_saved_residuals(fn, *args)
    return [line.split(" ")[0] for line in out.getvalue().splitlines()]


def test_attention_keeps_one_score_array_per_query_block():
    b, t, hq, hkv, d = 2, 104, 4, 2, 8  # query blocks 0-64 and 64-104, as the RL batch's
    rng = np.random.default_rng(0)
    q = jnp.asarray(rng.normal(size=(b, t, hq, d)), jnp.float32)
    kv = jnp.asarray(rng.normal(size=(b, t, hkv, d)), jnp.float32)
    seg = jnp.ones((b, t), jnp.int32)

    def loss(q, k, v):
        return jnp.sum(attention(q, k, v, segment_ids_BT=seg, impl="xla") ** 2)

    saved = _residual_shapes(loss, q, kv, kv)
    g = hq // hkv
    for start, end in query_blocks(t):  # each block's [B, K, G, Tq, S] probabilities, once
        shape = f"{b},{hkv},{g},{end - start},{end}]"
        assert sum(s.endswith(shape) and s.startswith("f32") for s in saved) == 1, saved
        assert not any(s.endswith(shape) and s.startswith("bool") for s in saved), saved
