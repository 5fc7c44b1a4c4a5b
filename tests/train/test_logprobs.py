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


@pytest.mark.parametrize("keep_probs_mb", [0, 1], ids=["recompute", "keep_softmax"])
def test_soft_capped_logits_chunked_forward_and_gradient_equal_full(model_cfg, make_toy,
                                                                    keep_probs_mb):
    """Gemma 2's final soft-cap (logits = c tanh(z / c)) in the chunked pass: log-probs, the
    entropy bonus's gradient and the loss gradient equal autodiff of the full capped logits
    (`Transformer.logits`), whether or not the softmax would fit `keep_probs_mb` (a capped
    pass always recomputes). A cap of 0.5 bends every logit of this model."""
    import dataclasses

    capped = create_model(dataclasses.replace(model_cfg, final_logit_softcap=0.5), seed=1)
    batch = jax.tree.map(jnp.asarray, make_toy(seed=4, t=16))
    graphdef, params = nnx.split(capped)
    w = jnp.asarray(np.random.default_rng(1).normal(size=batch.tokens.shape), jnp.float32)
    assert float(jnp.abs(capped(batch.tokens)).max()) < 0.5  # capped
    raw = nnx.merge(graphdef, params)
    h = raw.hidden(batch.tokens)
    assert float(jnp.abs(h @ raw.head_weight(h.dtype)).max()) > 0.5  # ... and the cap bends

    def chunked(p):
        m = nnx.merge(graphdef, p)
        h = m.hidden(batch.tokens, batch.positions, batch.segment_ids)
        lp, ent = logprobs_from_hidden(m.head_weight(h.dtype), h, batch.tokens,
                                       batch.segment_ids, chunk=4, keep_probs_mb=keep_probs_mb,
                                       entropy_grad=True, softcap=m.cfg.final_logit_softcap)
        return jnp.sum(lp * w) + 0.1 * jnp.sum(ent), lp

    def full(p):
        m = nnx.merge(graphdef, p)
        logits = m(batch.tokens, batch.positions, batch.segment_ids)[:, :-1]
        logp = jax.nn.log_softmax(logits, axis=-1)
        ent = -jnp.sum(jnp.exp(logp) * logp, axis=-1)
        seg = batch.segment_ids
        ok = (seg[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1])
        lp = jnp.take_along_axis(logp, batch.tokens[:, 1:, None], axis=-1)[..., 0]
        return jnp.sum(jnp.where(ok, lp, 0.0) * w[:, 1:]) + 0.1 * jnp.sum(jnp.where(ok, ent, 0))

    (_, lp), g1 = jax.value_and_grad(chunked, has_aux=True)(params)
    np.testing.assert_allclose(np.asarray(lp), np.asarray(full_logprobs_reference(capped, batch)),
                               rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(float(chunked(params)[0]), float(full(params)), rtol=1e-5)
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-4,
                                                    atol=1e-6)
    jax.tree.map(close, g1, jax.grad(full)(params))
