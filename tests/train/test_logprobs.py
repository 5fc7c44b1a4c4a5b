"""The chunked logprob pass equals the full-vocab reference, with the documented alignment."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.models import create_model
from jaxrl.train.logprobs import (
    chunk_size,
    full_logprobs_reference,
    logprobs_from_hidden,
    model_logprobs,
)


@pytest.fixture(scope="module")
def model(model_cfg):
    return create_model(model_cfg, seed=1)


def test_chunk_size():
    assert chunk_size(16, 8) == 8
    assert chunk_size(12, 8) == 6
    assert chunk_size(7, 128) == 7


@pytest.mark.parametrize("chunk", [4, 16, 5])
def test_chunked_equals_full_reference(model, make_toy, chunk):
    batch = jax.tree.map(jnp.asarray, make_toy(seed=1, t=16))
    got, ent = model_logprobs(model, batch, chunk=chunk)
    want = full_logprobs_reference(model, batch)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-6)
    seg = np.asarray(batch.segment_ids)
    assert np.all(np.asarray(got)[:, 0] == 0) and np.all(np.asarray(got)[seg == 0] == 0)
    assert np.all(np.asarray(ent)[seg[:, 1:].astype(bool).nonzero()[0], 1] > 0)


def test_alignment_by_hand(model, make_toy):
    # logp[b, t] must be log_softmax(logits[b, t-1])[tokens[b, t]].
    batch = jax.tree.map(jnp.asarray, make_toy(seed=2, t=8, ragged=False))
    logits = np.asarray(model(batch.tokens), np.float64)
    logp, _ = model_logprobs(model, batch, chunk=4)
    b, t = 3, 5
    row = logits[b, t - 1]
    want = row[int(batch.tokens[b, t])] - np.log(np.sum(np.exp(row - row.max()))) - row.max()
    assert float(logp[b, t]) == pytest.approx(want, rel=1e-5)


@pytest.mark.parametrize("keep_probs_mb", [0, 1], ids=["recompute", "keep_softmax"])
def test_chunked_gradient_equals_full(model, make_toy, keep_probs_mb):
    # [B, T, V] f32 of the toy batch is well under 1 MiB: keep_probs_mb=1 takes the kept-softmax
    # backward, 0 the recomputing one; both must equal autodiff of the full-logits reference.
    batch = jax.tree.map(jnp.asarray, make_toy(seed=3, t=16))
    graphdef, params = nnx.split(model)
    w = jnp.asarray(np.random.default_rng(0).normal(size=batch.tokens.shape), jnp.float32)

    def chunked(p):
        m = nnx.merge(graphdef, p)
        h = m.hidden(batch.tokens, batch.positions, batch.segment_ids)
        head_EV = m.head_weight(h.dtype)
        lp, _ = logprobs_from_hidden(head_EV, h, batch.tokens, batch.segment_ids, chunk=4,
                                     keep_probs_mb=keep_probs_mb)
        return jnp.sum(lp * w)

    def full(p):
        return jnp.sum(full_logprobs_reference(nnx.merge(graphdef, p), batch) * w)

    g1, g2 = jax.grad(chunked)(params), jax.grad(full)(params)
    close = lambda a, b: np.testing.assert_allclose(
        np.asarray(a), np.asarray(b), rtol=1e-4, atol=1e-6
    )
    jax.tree.map(close, g1, g2)
