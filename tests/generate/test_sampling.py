"""The per-slot sampler against `transformers`' logits processors, and its key derivation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.generate import sampling
from jaxrl.generate.sampling import (
    SamplingParams,
    ban_stop_ids,
    sample_key,
    sample_tokens,
    seed_key_data,
    top_candidates,
    transform_logits,
)
from jaxrl.models import lowp_dots


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


def test_transform_of_a_wide_row_matches_transformers_processors():
    # 20,000 entries: the candidates come from the two-level block search
    rng = np.random.default_rng(1)
    logits = rng.normal(size=(len(ROWS), 20000)).astype(np.float32) * 3
    t, k, p = (np.array(c) for c in zip(*ROWS, strict=True))
    out = np.asarray(transform_logits(jnp.asarray(logits), jnp.asarray(t, jnp.float32),
                                      jnp.asarray(k, jnp.int32), jnp.asarray(p, jnp.float32)))
    for i, row in enumerate(ROWS):
        want = _hf_transform(logits[i], *row)
        np.testing.assert_array_equal(np.isfinite(out[i]), np.isfinite(want), err_msg=str(row))
        finite = np.isfinite(want)
        np.testing.assert_allclose(out[i][finite], want[finite], rtol=1e-6, err_msg=str(row))


@pytest.mark.parametrize("cpu_engine", [False, True])  # blocks of 128; the CPU engine's size
@pytest.mark.parametrize("width", [97, 32000, 30001, 151936])  # plain top_k; blocks; padded
def test_top_candidates_equal_lax_top_k(width, cpu_engine):
    x = jax.random.normal(jax.random.key(width), (5, width)) * 3
    with lowp_dots.wide_results(cpu_engine):
        vals, idx = top_candidates(x, 64)
        vm_vals, vm_idx = top_candidates(x.T, 64, vocab_major=True)  # [V, B] read in place
    want_vals, want_idx = jax.lax.top_k(x, 64)
    vals, idx, want_idx = np.asarray(vals), np.asarray(idx), np.asarray(want_idx)
    np.testing.assert_array_equal(vals, np.asarray(want_vals))
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(x), idx, 1), vals)
    # the same indices, except where equal values may come in either order
    unique = np.array([[np.sum(row == v) == 1 for v in row] for row in vals])
    np.testing.assert_array_equal(idx[unique], want_idx[unique])
    np.testing.assert_array_equal(np.asarray(vm_vals), vals)
    np.testing.assert_array_equal(np.asarray(vm_idx), idx)


def test_ban_stop_ids_vocab_major_bans_the_same_entries():
    x = jax.random.normal(jax.random.key(0), (3, 10))
    stops, ban = jnp.asarray([[2, 9, -1]] * 3), jnp.asarray([True, False, True])
    want = np.asarray(ban_stop_ids(x, stops, ban))
    assert np.isneginf(want[[0, 0, 2, 2], [2, 9, 2, 9]]).all() and np.isfinite(want[1]).all()
    np.testing.assert_array_equal(np.asarray(ban_stop_ids(x.T, stops, ban, vocab_major=True)),
                                  want.T)


def test_top_candidates_with_ties_find_the_largest_values():
    # integer logits: thousands of ties, including across the 64th value
    x = jnp.round(jax.random.normal(jax.random.key(3), (4, 20000)) * 2)
    vals, idx = top_candidates(x, 64)
    np.testing.assert_array_equal(np.asarray(vals), np.asarray(jax.lax.top_k(x, 64)[0]))
    np.testing.assert_array_equal(np.take_along_axis(np.asarray(x), np.asarray(idx), 1),
                                  np.asarray(vals))
    assert all(len(set(row)) == 64 for row in np.asarray(idx).tolist())


def _reference_draw(logits, u, temperature, top_k, top_p):
    """Token and log-probability by the definition, in float64: the transformers-processed
    distribution, inverse CDF in vocabulary order; greedy: argmax, model log-probability."""
    if temperature == 0:
        tok = int(np.argmax(logits))
        x = logits.astype(np.float64)
        return tok, x[tok] - np.log(np.sum(np.exp(x - x.max()))) - x.max()
    x = _hf_transform(logits, float(temperature), int(top_k), float(top_p)).astype(np.float64)
    probs = np.exp(x - x.max())
    probs /= probs.sum()
    tok = int(np.searchsorted(np.cumsum(probs), u, side="right"))
    return tok, np.log(probs[tok])


def _mixed_rows(n, width, *, top_k_zero=False):
    rng = np.random.default_rng(5)
    logits = (rng.normal(size=(n, width)) * 3).astype(np.float32)
    logits[::7, : width // 5] = -np.inf  # banned entries (as `min_tokens` makes them)
    t = rng.choice([0.0, 0.5, 1.0, 1.7], n).astype(np.float32)
    k = rng.choice([1, 2, 20, 50], n).astype(np.int32)
    if top_k_zero:
        k[3] = 0
    p = rng.choice([1.0, 0.9, 0.5], n).astype(np.float32)
    return logits, t, k, p


def _assert_draws_are_defined(logits, t, k, p, seed):
    """`sample_tokens` on these rows draws, row by row, `_reference_draw`'s token."""
    keys = jax.vmap(lambda i: sample_key(seed_key_data(seed), 0, i))(jnp.arange(len(t)))
    u = np.asarray(jax.vmap(lambda key: jax.random.uniform(key, (), jnp.float32))(keys))
    args = keys, jnp.asarray(t), jnp.asarray(k), jnp.asarray(p)
    for vocab_major in (False, True):  # [B, V], and [V, B] as a CPU engine's lm head gives them
        given = jnp.asarray(logits.T if vocab_major else logits)
        toks, lps = sample_tokens(given, *args, vocab_major=vocab_major)
        for i in range(len(t)):
            want_tok, want_lp = _reference_draw(logits[i], u[i], t[i], k[i], p[i])
            assert int(toks[i]) == want_tok, (vocab_major, i, t[i], k[i], p[i])
            np.testing.assert_allclose(float(lps[i]), want_lp, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("width", [50, 20000])  # candidates = the whole row; two levels
def test_candidate_sampling_draws_the_defined_token(width, monkeypatch):
    logits, t, k, p = _mixed_rows(96, width)
    # the whole-row sampler must not run for these rows: make it return an impossible token
    monkeypatch.setattr(sampling, "_full_row", lambda *a: (jnp.full(len(t), -1, jnp.int32),
                                                           jnp.zeros(len(t))))
    _assert_draws_are_defined(logits, t, k, p, seed=3)


def test_a_row_without_top_k_samples_the_whole_row():
    logits, t, k, p = _mixed_rows(24, 20000, top_k_zero=True)
    t[3] = 1.0  # top_k 0 at temperature 1: the whole row may be drawn
    _assert_draws_are_defined(logits, t, k, p, seed=4)


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
