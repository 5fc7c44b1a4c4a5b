"""Entropy bonus (gradient through the chunked lm head), the GSPO aggregation rule, and the
reference-policy KL in the objective."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ConfigError, TrainConfig
from jaxrl.train.logprobs import logprobs_from_hidden


def _reference_entropy(w_EV, h_BTE):
    logp = jax.nn.log_softmax(jnp.einsum("bte,ev->btv", h_BTE, w_EV), axis=-1)
    return -jnp.sum(jnp.exp(logp) * logp, axis=-1)


@pytest.mark.parametrize("keep_mb", [0.0, 64.0])  # recompute the softmax / keep it
def test_entropy_gradient_matches_autodiff(keep_mb):
    rng = np.random.default_rng(0)
    b, t, e, v = 2, 8, 6, 11
    h = jnp.asarray(rng.normal(size=(b, t, e)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(e, v)), jnp.float32)
    tokens = jnp.asarray(rng.integers(0, v, (b, t)))
    seg = jnp.ones((b, t), jnp.int32)
    weights = jnp.asarray(rng.normal(size=(b, t)), jnp.float32)

    def ours(w, h):
        _, ent = logprobs_from_hidden(w, h, tokens, seg, chunk=4, keep_probs_mb=keep_mb,
                                      entropy_grad=True)
        return jnp.sum(ent * weights)

    def ref(w, h):  # same alignment: position t's entropy is that of the prediction at t-1
        ent_next = _reference_entropy(w, h)
        ent = jnp.concatenate([jnp.zeros((b, 1)), ent_next[:, :-1]], axis=1)
        return jnp.sum(ent * weights)

    np.testing.assert_allclose(ours(w, h), ref(w, h), rtol=1e-5, atol=1e-5)
    for g_ours, g_ref in zip(jax.grad(ours, (0, 1))(w, h), jax.grad(ref, (0, 1))(w, h),
                             strict=True):
        np.testing.assert_allclose(g_ours, g_ref, rtol=1e-4, atol=1e-5)


def test_two_way_entropy_gradient_by_hand():
    # logits (a, 0): p = sigmoid(a), H = -p log p - (1-p) log(1-p), dH/da = -p (1 - p) a
    a = 0.7
    h = jnp.asarray([[[a], [0.0]]], jnp.float32)  # [1, 2, 1]: position 0 predicts token 1
    w = jnp.asarray([[1.0, 0.0]], jnp.float32)  # [1, 2]: logits (h, 0)
    tokens, seg = jnp.asarray([[0, 1]]), jnp.ones((1, 2), jnp.int32)

    def ent_at_1(h):
        _, ent = logprobs_from_hidden(w, h, tokens, seg, chunk=2, entropy_grad=True)
        return ent[0, 1]

    p = 1.0 / (1.0 + np.exp(-a))
    assert float(ent_at_1(h)) == pytest.approx(-p * np.log(p) - (1 - p) * np.log(1 - p))
    assert float(jax.grad(ent_at_1)(h)[0, 0, 0]) == pytest.approx(-p * (1 - p) * a, rel=1e-5)
    # without the bonus the entropy is a statistic: no gradient
    _, ent = logprobs_from_hidden(w, h, tokens, seg, chunk=2)
    assert float(jax.grad(lambda h: logprobs_from_hidden(
        w, h, tokens, seg, chunk=2)[1][0, 1])(h)[0, 0, 0]) == 0.0
    assert float(ent[0, 1]) == pytest.approx(float(ent_at_1(h)))


def test_entropy_bonus_and_kl_in_the_loss_by_hand():
    from jaxrl.train.batch import make_batch
    from jaxrl.train.objective import policy_objective, prepare_targets

    mask = np.array([[0, 1, 1], [0, 1, 0]], np.float32)
    batch = make_batch(np.ones((2, 3), np.int32), mask, np.array([1.0, 0.0], np.float32),
                       np.array([0, 0]))
    logp = jnp.asarray([[0.0, -1.0, -2.0], [0.0, -0.5, 0.0]])
    ref = jnp.asarray([[0.0, -1.5, -2.0], [0.0, -0.5, 0.0]])
    ent = jnp.asarray([[0.0, 2.0, 1.0], [0.0, 3.0, 0.0]])
    cfg = TrainConfig(entropy_coef=0.1, kl_coef=0.5, kl_estimator="k1")
    batch = dataclasses.replace(batch, ref_logprobs=ref)
    tg, _ = prepare_targets(cfg, batch)
    loss, stats = policy_objective(cfg, logp, ent, batch, tg)
    # token_mean over 3 loss tokens: entropy mean (2+1+3)/3 = 2; k1 KL = logp - ref: 0.5,0,0
    assert float(stats["loss/entropy_bonus"]) == pytest.approx(-0.1 * 2.0)
    assert float(stats["loss/kl"]) == pytest.approx(0.5 / 3)
    assert float(loss) == pytest.approx(float(stats["loss/policy"]) + 0.5 * 0.5 / 3 - 0.2)
    assert float(stats["policy/ref_kl"]) == pytest.approx(0.5 / 3)


def test_gspo_uses_its_published_aggregation():
    assert TrainConfig(policy_loss="gspo").loss_aggregation == "seq_mean_token_mean"
    assert TrainConfig().loss_aggregation == "token_mean"
    with pytest.raises(ConfigError, match="not the published GSPO objective"):
        TrainConfig(policy_loss="gspo", aggregation="token_mean")
