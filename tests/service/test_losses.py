"""The SDK's built-in losses (jaxrl/service/losses.py) against hand-written values."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.service.losses import LOSSES, cispo, importance_sampling, ppo

CFG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def test_importance_sampling_gradient_is_weighted_policy_gradient():
    q = jnp.log(jnp.array([[0.5, 0.25]]))
    logp = q + jnp.array([[0.1, -0.2]])
    a = jnp.array([[2.0, -1.0]])
    inputs = {"logprobs": q, "advantages": a}
    grad = jax.grad(lambda lp: importance_sampling(lp, inputs, CFG).sum())(logp)
    np.testing.assert_allclose(grad, -np.exp([[0.1, -0.2]]) * a, rtol=1e-6)


def test_ppo_clips_where_the_ratio_leaves_the_band_in_the_advantage_direction():
    q = jnp.zeros((1, 4))
    r = jnp.array([[1.5, 1.5, 0.5, 1.0]])
    a = jnp.array([[1.0, -1.0, -1.0, 1.0]])
    out = ppo(jnp.log(r), {"logprobs": q, "advantages": a}, CFG)
    # A>0, r>high: clipped to 1.2; A<0, r>high: unclipped (min picks r A); A<0, r<low: 0.8
    np.testing.assert_allclose(out, [[-1.2, 1.5, 0.8, -1.0]], rtol=1e-6)
    grad = jax.grad(lambda lp: ppo(lp, {"logprobs": q, "advantages": a}, CFG).sum())(jnp.log(r))
    np.testing.assert_allclose(grad, [[0.0, 1.5, 0.0, -1.0]], rtol=1e-6)


def test_cispo_keeps_the_gradient_of_clipped_tokens():
    q = jnp.zeros((1, 2))
    logp = jnp.log(jnp.array([[1.5, 1.0]]))
    a = jnp.array([[1.0, 1.0]])
    grad = jax.grad(lambda lp: cispo(lp, {"logprobs": q, "advantages": a}, CFG).sum())(logp)
    np.testing.assert_allclose(grad, [[-1.2, -1.0]], rtol=1e-6)


def test_cross_entropy_is_weighted_nll_and_registry_is_complete():
    logp = jnp.log(jnp.array([[0.5, 0.25]]))
    out = LOSSES["cross_entropy"][0](logp, {"weights": jnp.array([[1.0, 0.0]])}, {})
    np.testing.assert_allclose(out, [[np.log(2.0), 0.0]], rtol=1e-6)
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo"}
