"""The Tinker SDK's maths (jaxrl/train/tinker.py) against hand-derived values: the built-in
losses, the unshifted chunked log-prob pass they take, and Adam (optax, per-call `AdamParams`)
against AdamW by hand in f64."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from jaxrl.train import tinker
from jaxrl.train.logprobs import target_logprobs
from jaxrl.train.tinker import (
    LOSSES,
    cispo,
    dro,
    gspo,
    importance_sampling,
    ppo,
    stable_reinforce,
)

CFG = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}


def test_importance_sampling_gradient_is_weighted_policy_gradient():
    q = jnp.log(jnp.array([[0.5, 0.25]]))
    logp = q + jnp.array([[0.1, -0.2]])
    a = jnp.array([[2.0, -1.0]])
    inputs = {"logprobs": q, "advantages": a}
    r = np.exp([[0.1, -0.2]])
    np.testing.assert_allclose(importance_sampling(logp, inputs, CFG), -r * a, rtol=1e-6)
    grad = jax.grad(lambda lp: importance_sampling(lp, inputs, CFG).sum())(logp)
    np.testing.assert_allclose(grad, -r * a, rtol=1e-6)


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
    out = cispo(logp, {"logprobs": q, "advantages": a}, CFG)
    np.testing.assert_allclose(out, [[-1.2 * np.log(1.5), 0.0]], rtol=1e-6)  # weight clipped
    grad = jax.grad(lambda lp: cispo(lp, {"logprobs": q, "advantages": a}, CFG).sum())(logp)
    np.testing.assert_allclose(grad, [[-1.2, -1.0]], rtol=1e-6)


def test_cross_entropy_is_weighted_nll_and_registry_is_complete():
    logp = jnp.log(jnp.array([[0.5, 0.25]]))
    out = LOSSES["cross_entropy"][0](logp, {"weights": jnp.array([[1.0, 0.0]])}, {})
    np.testing.assert_allclose(out, [[np.log(2.0), 0.0]], rtol=1e-6)
    assert set(LOSSES) == {"cross_entropy", "importance_sampling", "ppo", "cispo", "gspo", "dro",
                           "stable_reinforce"}


def test_target_logprobs_is_the_full_log_softmax_at_each_position_with_its_gradient():
    """The service's alignment (Tinker's `target_tokens`: no shift) through the trainer's
    chunked pass equals log_softmax(h w)[target] at every position, values and gradients."""
    rng = np.random.default_rng(0)
    h = jnp.asarray(rng.normal(size=(2, 8, 6)), jnp.float32)
    w = jnp.asarray(rng.normal(size=(6, 11)), jnp.float32)
    tgt = jnp.asarray(rng.integers(0, 11, (2, 8)), jnp.int32)
    ct = jnp.asarray(rng.normal(size=(2, 8)), jnp.float32)

    def full(h, w):
        return jnp.take_along_axis(jax.nn.log_softmax(h @ w), tgt[..., None], axis=-1)[..., 0]

    for keep_mb in (0.0, 1.0):  # the backward recomputes the softmax / keeps it
        def chunked(h, w, keep_mb=keep_mb):  # chunk 3 -> 4 chunks of 2 positions
            return target_logprobs(w, h, tgt, chunk=3, keep_probs_mb=keep_mb)[0]

        np.testing.assert_allclose(chunked(h, w), full(h, w), rtol=1e-5, atol=1e-6)
        grads = [jax.grad(lambda h, w, f=f: jnp.sum(f(h, w) * ct), argnums=(0, 1))(h, w)
                 for f in (chunked, full)]
        for a, b in zip(*grads, strict=True):
            np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-5)


# ----------------------------------------------------------------------------- Adam

P0 = np.array([0.5, -1.0, 2.0])
G1, G2 = np.array([0.3, -0.2, 0.1]), np.array([-0.1, 0.4, 0.2])


def step(params, grad, state, **adam):
    """`Backend.optim_step`'s update: the hyper-parameters set in the state, then one step."""
    state.hyperparams.update(
        {k: jnp.float32(adam.get(k, v)) for k, v in tinker.ADAM_DEFAULTS.items()})
    return tinker.adam_update(params, {"w": jnp.asarray(grad, jnp.float32)}, state)


def close(params, expected):
    np.testing.assert_allclose(np.asarray(params["w"]), expected, rtol=2e-6, atol=1e-7)


def test_two_steps_equal_adamw_by_hand_with_each_calls_hyperparameters():
    params = {"w": jnp.asarray(P0, jnp.float32)}
    state = tinker.adam_state(params)
    params, state, gnorm = step(params, G1, state, learning_rate=0.1, eps=1e-8, weight_decay=0.01)
    # step 1: m = (1 - b1) g, v = (1 - b2) g^2, so m_hat = g and v_hat = g^2
    p1 = P0 - 0.1 * (G1 / (np.abs(G1) + 1e-8) + 0.01 * P0)
    close(params, p1)
    np.testing.assert_allclose(float(gnorm), np.linalg.norm(G1), rtol=1e-6)
    # step 2 with other betas, eps, lr and no decay: this call's betas fold the moments and
    # correct the bias at k = 2; eps is added outside the square root
    params, state, _ = step(params, G2, state, learning_rate=0.05, beta1=0.8, beta2=0.99,
                            eps=1e-3)
    m = 0.8 * (0.1 * G1) + 0.2 * G2
    v = 0.99 * (0.05 * G1**2) + 0.01 * G2**2
    p2 = p1 - 0.05 * (m / (1 - 0.8**2)) / (np.sqrt(v / (1 - 0.99**2)) + 1e-3)
    close(params, p2)
    mu, nu = tinker.adam_moments(state)
    # atol: m[0] = 0.024 - 0.02 cancels in f32
    np.testing.assert_allclose(np.asarray(mu["w"]), m, rtol=1e-6, atol=2e-8)
    np.testing.assert_allclose(np.asarray(nu["w"]), v, rtol=1e-6, atol=2e-8)


def test_clipping_by_global_norm_and_zero_meaning_none():
    g = np.array([3.0, 4.0, 0.0])  # global norm 5
    for clip, scale in ((0.0, 1.0), (1.0, 0.2), (10.0, 1.0)):
        params = {"w": jnp.asarray(P0, jnp.float32)}
        params, _, gnorm = step(params, g, tinker.adam_state(params), learning_rate=0.1,
                                eps=1.0, grad_clip_norm=clip)
        # eps = 1 makes step 1 depend on the gradient's scale: g' / (|g'| + 1), g' = scale g
        close(params, P0 - 0.1 * (scale * g) / (np.abs(scale * g) + 1.0))
        assert float(gnorm) == 5.0  # reported before clipping


def test_resuming_saved_moments_continues_the_same_run():
    params = {"w": jnp.asarray(P0, jnp.float32)}
    params, state, _ = step(params, G1, tinker.adam_state(params), learning_rate=0.1)
    p1, (mu, nu) = np.asarray(params["w"]), jax.tree.map(np.asarray, tinker.adam_moments(state))

    def w():  # fresh buffers each time: adam_update donates its params and state
        return {"w": jnp.asarray(p1)}

    resumed, _, _ = step(w(), G2, tinker.adam_state(w(), mu, nu, steps=1), learning_rate=0.1)
    continued, _, _ = step(params, G2, state, learning_rate=0.1)
    np.testing.assert_array_equal(np.asarray(resumed["w"]), np.asarray(continued["w"]))
    fresh, _, _ = step(w(), G2, tinker.adam_state(w()), learning_rate=0.1)
    assert not np.allclose(np.asarray(fresh["w"]), np.asarray(continued["w"]))  # moments count


def test_gspo_tokens_carry_the_sequence_ratio_with_their_own_gradient():
    """Log-ratios 0.2 and -0.1 on the masked tokens: s = exp(0.05) for every token of the
    sequence; a token's gradient is -s A_t where unclipped, 0 where the clip binds."""
    q = jnp.log(jnp.array([[0.5, 0.25, 0.4]]))
    logp = q + jnp.array([[0.2, -0.1, 3.0]])  # the third token is outside the mask
    mask = jnp.array([[1.0, 1.0, 0.0]])
    s = np.exp(0.05)
    wide = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    narrow = LOSSES["gspo"][3]  # GSPO's own ranges: 1 - 3e-4, 1 + 4e-4
    for a, cfg, want, grad_want in [
        ([[2.0, -1.0, 1.0]], wide, [[-2 * s, s, -s]], [[-2 * s, s, -s]]),
        # s > 1 + 4e-4: clipped where A > 0 (value at the bound, no gradient), not where A < 0
        ([[2.0, -1.0, 1.0]], narrow, [[-2 * (1 + 4e-4), s, -(1 + 4e-4)]], [[0.0, s, 0.0]]),
    ]:
        inputs = {"logprobs": q, "advantages": jnp.array(a), "sequence_ratio_mask": mask}
        np.testing.assert_allclose(gspo(logp, inputs, cfg), want, rtol=1e-6)
        grad = jax.grad(lambda lp, inputs=inputs, cfg=cfg: gspo(lp, inputs, cfg).sum())(logp)
        np.testing.assert_allclose(grad, grad_want, rtol=1e-6, atol=1e-7)
    # no mask sent (-1): the tokens with a non-zero advantage, here the first two
    inputs = {"logprobs": q, "advantages": jnp.array([[2.0, -1.0, 0.0]]),
              "sequence_ratio_mask": jnp.full((1, 3), -1.0)}
    np.testing.assert_allclose(gspo(logp, inputs, wide), [[-2 * s, s, 0.0]], rtol=1e-6)


def test_dro_is_policy_gradient_minus_a_quadratic_log_ratio_penalty():
    """logp -1, q -1.5, A 2, beta 0.1: L = -(-1 * 2 - 0.05 * 0.5^2) = 2.0125 and
    dL/dlogp = -(A - beta (logp - q)) = -(2 - 0.05) = -1.95."""
    inputs = {"logprobs": jnp.array([[-1.5, -0.5]]), "advantages": jnp.array([[2.0, -1.0]])}
    logp = jnp.array([[-1.0, -0.5]])
    cfg = {"beta": 0.1}
    np.testing.assert_allclose(dro(logp, inputs, cfg), [[2.0125, -0.5]], rtol=1e-6)
    grad = jax.grad(lambda lp: dro(lp, inputs, cfg).sum())(logp)
    np.testing.assert_allclose(grad, [[-1.95, 1.0]], rtol=1e-6)
    # a prompt position as the cookbook sends it (q 0, A 0): no penalty, no gradient; a
    # sampled token with A 0 keeps its penalty: logp -2, q -1 -> 0.05 * 1 = 0.05, grad 0.1 * -1
    inputs = {"logprobs": jnp.array([[0.0, -1.0]]), "advantages": jnp.array([[0.0, 0.0]])}
    logp = jnp.array([[-30.0, -2.0]])
    np.testing.assert_allclose(dro(logp, inputs, cfg), [[0.0, 0.05]], rtol=1e-6)
    grad = jax.grad(lambda lp: dro(lp, inputs, cfg).sum())(logp)
    np.testing.assert_allclose(grad, [[0.0, -0.1]], rtol=1e-6)


def test_stable_reinforce_weights_reinforce_by_the_recorded_ratio_and_masks_outside_the_band():
    """Tokens 0-3 sampled (recorded q), token 4 a prompt position. Ratios r = p / q by hand:
    1.0 (on-policy), 1.5 (inside [0.5, 2]), 3.0 (above: masked), 0.25 (below: masked); the
    prompt position has A = 1 but m = 0. L_t = -m w A log p, dL/dlog p = -m w A (w held)."""
    q = np.log([0.2, 0.2, 0.1, 0.4, 0.5])
    p = np.array([0.2, 0.3, 0.3, 0.1, 0.5])
    a = np.array([2.0, -1.0, 1.0, 1.0, 1.0])
    inputs = {"recorded_logprobs": jnp.asarray([q], jnp.float32),
              "sampled": jnp.array([[1.0, 1.0, 1.0, 1.0, 0.0]]),
              "advantages": jnp.asarray([a], jnp.float32)}
    cfg = LOSSES["stable_reinforce"][3]
    assert cfg == {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0}
    logp = jnp.asarray([np.log(p)], jnp.float32)
    w = np.array([1.0, 1.5, 0.0, 0.0, 0.0])
    np.testing.assert_allclose(stable_reinforce(logp, inputs, cfg)[0], -w * a * np.log(p),
                               rtol=1e-5)
    grad = jax.grad(lambda lp: stable_reinforce(lp, inputs, cfg).sum())(logp)
    np.testing.assert_allclose(grad[0], [-2.0, 1.5, 0.0, 0.0, 0.0], rtol=1e-5)
    # a wider band keeps the ratio-3 token, weighted by its ratio: dL/dlog p = -3 * 1
    wide = {"clip_low_threshold": 0.1, "clip_high_threshold": 4.0}
    grad = jax.grad(lambda lp: stable_reinforce(lp, inputs, wide).sum())(logp)
    np.testing.assert_allclose(grad[0], [-2.0, 1.5, -3.0, -0.25, 0.0], rtol=1e-5)
