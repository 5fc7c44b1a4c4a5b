"""The per-slot sampler against `transformers`' logits processors, and its key derivation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.generate.sampling import (
    SamplingParams,
    sample_key,
    sample_tokens,
    seed_key_data,
    transform_logits,
)


def _hf_transform(logits, temperature, top_k, top_p):
    import torch
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    x = torch.tensor(logits[None])
    if temperature == 0:
        return x[0].numpy()
    x = TemperatureLogitsWarper(temperature)(None, x)
    if top_k > 0:
        x = TopKLogitsWarper(top_k)(None, x)
    if top_p < 1:
        x = TopPLogitsWarper(top_p)(None, x)
    return x[0].numpy()


ROWS = [(1.0, 0, 1.0), (0.7, 5, 1.0), (1.3, 0, 0.8), (0.5, 10, 0.6), (0.0, 3, 0.5),
        (1.0, 200, 0.95)]


@pytest.mark.parametrize("candidates", [4, 64, 1000])  # sort fallback, mixed, candidates only
def test_transform_matches_transformers_processors(candidates):
    rng = np.random.default_rng(0)
    logits = rng.normal(size=(len(ROWS), 97)).astype(np.float32) * 3
    t, k, p = (np.array(c) for c in zip(*ROWS, strict=True))
    out = np.asarray(transform_logits(jnp.asarray(logits), jnp.asarray(t, jnp.float32),
                                      jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32),
                                      candidates=candidates))
    for i, row in enumerate(ROWS):
        want = _hf_transform(logits[i], *row)
        np.testing.assert_array_equal(np.isfinite(out[i]), np.isfinite(want), err_msg=str(row))
        finite = np.isfinite(want)
        np.testing.assert_allclose(out[i][finite], want[finite], rtol=1e-6, err_msg=str(row))


def test_sampled_frequencies_and_logprobs_follow_the_distribution():
    logits = jnp.log(jnp.asarray([[0.5, 0.25, 0.15, 0.1]], jnp.float32))
    n = 20000
    keys = jax.vmap(lambda i: sample_key(seed_key_data(1), 0, i))(jnp.arange(n))
    rep = lambda x, dt: jnp.full((n,), x, dt)
    toks, lps = sample_tokens(jnp.broadcast_to(logits, (n, 4)), keys, rep(1.0, jnp.float32),
                              rep(0, jnp.int32), rep(1.0, jnp.float32))
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    np.testing.assert_allclose(freq, [0.5, 0.25, 0.15, 0.1], atol=0.015)
    np.testing.assert_allclose(np.exp(np.asarray(lps)), np.asarray([0.5, 0.25, 0.15, 0.1])[toks],
                               rtol=1e-5)
    # top_k=2: only the two most likely tokens, renormalised.
    toks, lps = sample_tokens(jnp.broadcast_to(logits, (n, 4)), keys, rep(1.0, jnp.float32),
                              rep(2, jnp.int32), rep(1.0, jnp.float32))
    freq = np.bincount(np.asarray(toks), minlength=4) / n
    np.testing.assert_allclose(freq, [2 / 3, 1 / 3, 0, 0], atol=0.015)
    np.testing.assert_allclose(np.exp(np.asarray(lps)), np.asarray([2 / 3, 1 / 3])[toks], rtol=1e-5)


def test_greedy_rows_take_argmax_with_model_logprob():
    logits = jnp.asarray([[0.1, 2.0, -1.0]], jnp.float32)
    tok, lp = sample_tokens(logits, sample_key(seed_key_data(0), 0, 0)[None],
                            jnp.zeros((1,)), jnp.asarray([1], jnp.int32), jnp.ones((1,)))
    assert int(tok[0]) == 1
    np.testing.assert_allclose(float(lp[0]), float(jax.nn.log_softmax(logits)[0, 1]), rtol=1e-6)


@pytest.mark.parametrize("seed", [0, 7, 2**31 + 5])
def test_seed_key_data_matches_jax_key(seed):
    np.testing.assert_array_equal(seed_key_data(seed), jax.random.key_data(jax.random.key(seed)))


@pytest.mark.parametrize("kw, match", [
    (dict(n=0), "n must be"), (dict(max_tokens=0), "max_tokens"), (dict(temperature=-1), "temp"),
    (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(seed=-1), "seed"),
])
def test_sampling_params_reject_bad_values(kw, match):
    with pytest.raises(ValueError, match=match):
        SamplingParams(**kw)
