"""RL maths: hand-computed values on small arrays and invariances (milliseconds, no model)."""

import math

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.train import algorithms as A
from jaxrl.train import config as C

F = np.float32


def _np(x):
    return np.asarray(x, dtype=np.float64)


# ------------------------------------------------------------------ registries


def test_registry_names_match_config_choices():
    assert A.ADVANTAGES.names() == C.ADVANTAGE_NAMES
    assert A.POLICY_LOSSES.names() == C.POLICY_LOSS_NAMES
    assert A.AGGREGATIONS.names() == C.AGGREGATION_NAMES
    assert A.KL_ESTIMATORS.names() == C.KL_ESTIMATOR_NAMES
    assert A.CORRECTIONS.names() == C.CORRECTION_NAMES


def test_unknown_name_lists_valid_names():
    with pytest.raises(ValueError, match=r"unknown policy loss 'ppo'.*'cispo', 'gspo', 'ppo_clip'"):
        A.POLICY_LOSSES.get("ppo")
    with pytest.raises(ValueError, match=r"train.advantage='gae'.*\['drgrpo', 'grpo', 'rloo'\]"):
        C.TrainConfig(advantage="gae")
    with pytest.raises(ValueError, match=r"train.correction='is'.*tis_token"):
        C.TrainConfig(correction="is")
    with pytest.raises(ValueError, match=r"train.micro_batches=0.*>= 1"):
        C.TrainConfig(micro_batches=0)


def test_every_function_has_equation_and_source_in_docstring():
    for reg in (A.ADVANTAGES, A.POLICY_LOSSES, A.AGGREGATIONS, A.KL_ESTIMATORS, A.CORRECTIONS):
        for name in reg.names():
            doc = reg.get(name).__doc__ or ""
            assert "=" in doc, f"{reg.kind} {name}: no equation in docstring"
            if reg is not A.CORRECTIONS or name != "none":
                assert any(ch.isdigit() for ch in doc), f"{reg.kind} {name}: no source year"


# ------------------------------------------------------------------ advantages

# Group 0 = rewards [1, 0, 1, 0]: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = sqrt(1/3).
# Group 1 = rewards [3, 1]: mean 2, unbiased std sqrt((1 + 1) / 1) = sqrt(2).
# Row 6 is padding (valid 0) in group 2.
R = np.array([1, 0, 1, 0, 3, 1, 7], F)
G = np.array([0, 0, 0, 0, 1, 1, 2], np.int32)
V = np.array([1, 1, 1, 1, 1, 1, 0], F)


def test_grpo_advantages_hand_computed():
    s0, s1 = math.sqrt(1 / 3), math.sqrt(2)
    want = [0.5 / s0, -0.5 / s0, 0.5 / s0, -0.5 / s0, 1 / s1, -1 / s1, 0]
    got = A.ADVANTAGES.get("grpo")(R, G, V, eps=0.0)
    np.testing.assert_allclose(_np(got), want, rtol=1e-6)


def test_drgrpo_advantages_hand_computed():
    got = A.ADVANTAGES.get("drgrpo")(R, G, V, eps=1e-6)
    np.testing.assert_allclose(_np(got), [0.5, -0.5, 0.5, -0.5, 1, -1, 0], rtol=1e-6)


def test_rloo_advantages_hand_computed():
    # r=1 in group 0: others [0, 1, 0] mean 1/3 -> 2/3; r=0: others [1, 0, 1] mean 2/3 -> -2/3.
    # group 1: 3 - 1 = 2, 1 - 3 = -2.
    got = A.ADVANTAGES.get("rloo")(R, G, V, eps=1e-6)
    np.testing.assert_allclose(_np(got), [2 / 3, -2 / 3, 2 / 3, -2 / 3, 2, -2, 0], rtol=1e-6)


def test_singleton_and_constant_groups_have_zero_advantage():
    r = np.array([5, 2, 2], F)
    g = np.array([0, 1, 1], np.int32)
    v = np.ones(3, F)
    for name in C.ADVANTAGE_NAMES:
        np.testing.assert_allclose(_np(A.ADVANTAGES.get(name)(r, g, v, eps=1e-6)), 0, atol=1e-6)


def test_overlong_penalty_hand_computed():
    # L_max = 10, L_cache = 4 -> soft zone (6, 10]: (6 - |y|) / 4.
    got = A.overlong_penalty(np.array([3, 6, 8, 10, 11]), max_len=10, cache_len=4)
    np.testing.assert_allclose(_np(got), [0, 0, -0.5, -1, -1], rtol=1e-6)


# ------------------------------------------------------------------ policy losses

KW = dict(eps_low=0.2, eps_high=0.28)


def _rows(ratios, adv, logp=-1.0):
    """One row per advantage; tokens have the given ratios pi/pi_old; last token masked out."""
    lr = np.log(np.asarray(ratios, F))
    logp_BT = np.full((len(adv), len(ratios)), logp, F)
    old_BT = logp_BT - lr[None, :]
    mask_BT = np.ones_like(logp_BT)
    mask_BT[:, -1] = 0
    return logp_BT, old_BT, np.asarray(adv, F), mask_BT


def test_ppo_clip_hand_computed():
    # ratios r = [1.5, 0.5, 1.1, 1.0 (masked)], clip range [0.8, 1.28].
    # A=+1: max(-r, -clip(r)) = [-1.28 (clipped), -0.5, -1.1]; clip frac 1/3.
    # A=-1: max(r, clip(r))   = [1.5, 0.8 (clipped), 1.1];      clip frac 1/3.
    logp, old, adv, mask = _rows([1.5, 0.5, 1.1, 1.0], [1.0, -1.0])
    loss, st = A.ppo_clip_loss(logp, old, adv, mask, **KW)
    np.testing.assert_allclose(_np(loss), [[-1.28, -0.5, -1.1, 0], [1.5, 0.8, 1.1, 0]], rtol=1e-5)
    np.testing.assert_allclose(float(st["clip_frac"]), 2 / 6, rtol=1e-6)


def test_ppo_dual_clip_hand_computed():
    # A=-1, r=5: max(5, 1.28) = 5, dual clip c=3 caps it at -c*A = 3. r=1.1: 1.1 (below the cap).
    logp, old, adv, mask = _rows([5.0, 1.1, 1.0], [-1.0])
    loss, st = A.ppo_clip_loss(logp, old, adv, mask, dual_clip=3.0, **KW)
    np.testing.assert_allclose(_np(loss), [[3.0, 1.1, 0]], rtol=1e-5)
    np.testing.assert_allclose(float(st["dual_clip_frac"]), 0.5)


def test_ppo_gradient_is_zero_where_clipped():
    logp, old, adv, mask = _rows([1.5, 1.1, 1.0], [1.0])
    g = jax.grad(lambda lp: jnp.sum(A.ppo_clip_loss(lp, old, adv, mask, **KW)[0]))(logp)
    # d(-A r)/dlogp = -A r: token 0 clipped -> 0, token 1 -> -1.1, token 2 masked -> 0.
    np.testing.assert_allclose(_np(g), [[0, -1.1, 0]], rtol=1e-5)


def test_gspo_hand_computed():
    # log ratios [0.2, -0.1, (masked)] -> s = exp(0.05); A=1 in range -> loss = -s on each token,
    # grad = -A s per token. Row 2: log ratios [0.5, 0.5] -> s = e^0.5 > 1.28 -> loss -1.28, grad 0.
    logp = np.array([[-1.0, -1.0, -1.0], [-1.0, -1.0, -1.0]], F)
    old = logp - np.array([[0.2, -0.1, 3.0], [0.5, 0.5, 3.0]], F)
    mask = np.array([[1, 1, 0], [1, 1, 0]], F)
    adv = np.array([1.0, 1.0], F)
    s = math.exp(0.05)
    fn = lambda lp: A.gspo_loss(lp, old, adv, mask, **KW)
    loss, st = fn(logp)
    np.testing.assert_allclose(_np(loss), [[-s, -s, 0], [-1.28, -1.28, 0]], rtol=1e-5)
    np.testing.assert_allclose(float(st["clip_frac"]), 0.5)
    g = jax.grad(lambda lp: jnp.sum(fn(lp)[0]))(logp)
    np.testing.assert_allclose(_np(g), [[-s, -s, 0], [0, 0, 0]], rtol=1e-5, atol=1e-7)


def test_cispo_hand_computed():
    # r = 1.5 -> weight clip(1.5, 0.8, 1.28) = 1.28 (no gradient); loss = -1.28 * A * logp.
    # logp = -0.7, A = 2 -> loss = 1.792, d loss / d logp = -2.56 (the clipped token still learns).
    logp, old, _, mask = _rows([1.5, 1.0], [2.0], logp=-0.7)
    adv = np.array([2.0], F)
    fn = lambda lp: A.cispo_loss(lp, old, adv, mask, **KW)
    loss, st = fn(logp)
    np.testing.assert_allclose(_np(loss), [[1.792, 0]], rtol=1e-5)
    g = jax.grad(lambda lp: jnp.sum(fn(lp)[0]))(logp)
    np.testing.assert_allclose(_np(g), [[-2.56, 0]], rtol=1e-5)
    np.testing.assert_allclose(float(st["clip_frac"]), 1.0)


@pytest.mark.parametrize("name", C.POLICY_LOSS_NAMES)
def test_on_policy_gradient_is_policy_gradient(name):
    # With pi_old == sg(pi), every loss has gradient -A per loss token (REINFORCE), 0 elsewhere.
    logp = np.array([[-0.5, -1.5, -2.0]], F)
    mask = np.array([[1, 1, 0]], F)
    adv = np.array([0.7], F)

    def f(lp):
        loss, _ = A.POLICY_LOSSES.get(name)(lp, jax.lax.stop_gradient(lp), adv, mask, **KW)
        return jnp.sum(loss)

    np.testing.assert_allclose(_np(jax.grad(f)(logp)), [[-0.7, -0.7, 0]], rtol=1e-6)


@pytest.mark.parametrize("name", C.POLICY_LOSS_NAMES)
def test_masked_tokens_contribute_nothing(name):
    rng = np.random.default_rng(0)
    logp = rng.normal(size=(3, 5)).astype(F) - 2
    old = logp + rng.normal(scale=0.3, size=(3, 5)).astype(F)
    adv = rng.normal(size=(3,)).astype(F)
    mask = np.array([[1, 1, 1, 0, 0], [1, 0, 1, 1, 0], [0, 1, 1, 1, 1]], F)
    garbage_logp, garbage_old = logp.copy(), old.copy()
    garbage_logp[mask == 0] = 15.0
    garbage_old[mask == 0] = -40.0
    fn = A.POLICY_LOSSES.get(name)
    agg = A.AGGREGATIONS.get("token_mean")
    nt, ns = A.batch_counts(mask)

    def total(lp, od):
        loss, st = fn(lp, od, adv, mask, **KW)
        return agg(loss, mask, num_tokens=nt, num_seqs=ns, norm_len=5), st

    (l0, s0), g0 = jax.value_and_grad(total, has_aux=True)(logp, old)
    (l1, s1), g1 = jax.value_and_grad(total, has_aux=True)(garbage_logp, garbage_old)
    np.testing.assert_allclose(float(l0), float(l1), rtol=1e-6)
    np.testing.assert_allclose(_np(g0) * mask, _np(g1) * mask, rtol=1e-6)
    assert np.all(_np(g1)[mask == 0] == 0)
    for k in s0:
        np.testing.assert_allclose(float(s0[k]), float(s1[k]), rtol=1e-6, err_msg=k)


# ------------------------------------------------------------------ aggregation

LOSS = np.array([[1, 2, 3, 0], [4, 0, 0, 0]], F)
MASK = np.array([[1, 1, 1, 0], [1, 0, 0, 0]], F)


def _agg(name, loss=LOSS, mask=MASK, norm_len=4):
    nt, ns = A.batch_counts(mask)
    return float(
        A.AGGREGATIONS.get(name)(loss, mask, num_tokens=nt, num_seqs=ns, norm_len=norm_len)
    )


def test_aggregations_hand_computed():
    assert _agg("token_mean") == pytest.approx((1 + 2 + 3 + 4) / 4)  # 2.5
    assert _agg("seq_mean_token_mean") == pytest.approx((6 / 3 + 4 / 1) / 2)  # 3.0
    assert _agg("seq_mean_token_sum_norm") == pytest.approx(10 / (2 * 4))  # 1.25


def test_token_mean_vs_seq_mean_differ_as_defined():
    # token_mean = sum_i n_i m_i / sum_i n_i, seq_mean = 1/N sum_i m_i (m_i = per-seq mean, n_i =
    # length): the difference is sum_i m_i (n_i / sum n - 1/N), zero iff lengths are equal (or m_i
    # are).
    n = MASK.sum(-1)
    m = (LOSS * MASK).sum(-1) / n
    want = float(np.sum(m * (n / n.sum() - 1 / len(n))))
    assert _agg("token_mean") - _agg("seq_mean_token_mean") == pytest.approx(want)
    assert want != 0
    eq_mask = np.array([[1, 1, 0, 0], [1, 1, 0, 0]], F)
    assert _agg("token_mean", mask=eq_mask) == pytest.approx(
        _agg("seq_mean_token_mean", mask=eq_mask)
    )


def test_aggregation_over_micro_batches_sums_to_full_batch():
    rng = np.random.default_rng(1)
    loss = rng.normal(size=(4, 6)).astype(F)
    mask = (rng.random((4, 6)) > 0.4).astype(F)
    mask[3] = 0  # an all-padding row counts for nothing
    nt, ns = A.batch_counts(mask)
    for name in C.AGGREGATION_NAMES:
        fn = A.AGGREGATIONS.get(name)
        full = fn(loss, mask, num_tokens=nt, num_seqs=ns, norm_len=6)
        parts = sum(
            fn(loss[i : i + 2], mask[i : i + 2], num_tokens=nt, num_seqs=ns, norm_len=6)
            for i in (0, 2)
        )
        np.testing.assert_allclose(float(full), float(parts), rtol=1e-6, err_msg=name)


# ------------------------------------------------------------------ KL


def test_kl_estimators_hand_computed():
    # logp = -1, ref = -2: log r = ref - logp = -1. k1 = 1, k2 = 0.5, k3 = e^-1 - 1 + 1 = e^-1.
    lp, ref = np.array([[-1.0]], F), np.array([[-2.0]], F)
    assert float(A.k1(lp, ref)[0, 0]) == pytest.approx(1.0)
    assert float(A.k2(lp, ref)[0, 0]) == pytest.approx(0.5)
    assert float(A.k3(lp, ref)[0, 0]) == pytest.approx(math.exp(-1), rel=1e-6)
    for name in C.KL_ESTIMATOR_NAMES:
        assert float(A.KL_ESTIMATORS.get(name)(lp, lp)[0, 0]) == 0.0


# ------------------------------------------------------------------ off-policy corrections


def test_tis_token_hand_computed():
    # pi_old / mu = [3, 0.5] -> truncated at C = 2 -> [2, 0.5]; mean 1.25, max 2.
    old = np.log(np.array([[0.6, 0.1]], F))
    behav = np.log(np.array([[0.2, 0.2]], F))
    mask = np.ones_like(old)
    w, m, st = A.tis_token(old, behav, mask, cap=2.0, m2_tau=1.0)
    np.testing.assert_allclose(_np(w), [[2.0, 0.5]], rtol=1e-6)
    np.testing.assert_allclose(_np(m), _np(mask))
    assert float(st["is_weight_mean"]) == pytest.approx(1.25)
    assert float(st["is_weight_max"]) == pytest.approx(2.0)


def test_tis_seq_hand_computed():
    # per-token ratios [3, 0.5, (masked 100)] -> product 1.5 on every token; with C = 1.2 -> 1.2.
    old = np.log(np.array([[0.6, 0.1, 1.0]], F))
    behav = np.log(np.array([[0.2, 0.2, 0.01]], F))
    mask = np.array([[1, 1, 0]], F)
    w, _, _ = A.tis_seq(old, behav, mask, cap=2.0, m2_tau=1.0)
    np.testing.assert_allclose(_np(w)[0, :2], [1.5, 1.5], rtol=1e-5)
    w, _, _ = A.tis_seq(old, behav, mask, cap=1.2, m2_tau=1.0)
    np.testing.assert_allclose(_np(w)[0, :2], [1.2, 1.2], rtol=1e-5)


def test_m2po_hand_computed():
    # log ratios [0.1, 0.2, 0.3, 1.0, (masked 5.0)] -> M2 = [0.01, 0.04, 0.09, 1.0].
    # Sorted prefix means: 0.01, 0.025, 0.0467, 0.285. tau = 0.05 keeps 3 (drops the 1.0 token);
    # tau = 0.02 keeps only the smallest.
    behav = np.zeros((1, 5), F) - 1
    old = behav + np.array([[0.1, 0.2, 0.3, 1.0, 5.0]], F)
    mask = np.array([[1, 1, 1, 1, 0]], F)
    w, m, st = A.m2po(old, behav, mask, cap=2.0, m2_tau=0.05)
    np.testing.assert_allclose(_np(m), [[1, 1, 1, 0, 0]])
    np.testing.assert_allclose(_np(w), 1.0)
    assert float(st["masked_token_frac"]) == pytest.approx(0.25)
    assert float(st["m2"]) == pytest.approx((0.01 + 0.04 + 0.09 + 1.0) / 4, rel=1e-5)
    _, m, _ = A.m2po(old, behav, mask, cap=2.0, m2_tau=0.02)
    np.testing.assert_allclose(_np(m), [[1, 0, 0, 0, 0]])


def test_m2po_is_batch_global_and_order_free():
    rng = np.random.default_rng(2)
    behav = rng.normal(size=(4, 8)).astype(F) - 2
    old = behav + rng.normal(scale=0.3, size=(4, 8)).astype(F)
    mask = (rng.random((4, 8)) > 0.3).astype(F)
    _, m, _ = A.m2po(old, behav, mask, cap=2.0, m2_tau=0.03)
    _, m_rev, _ = A.m2po(old[::-1], behav[::-1], mask[::-1], cap=2.0, m2_tau=0.03)
    np.testing.assert_array_equal(_np(m), _np(m_rev)[::-1])
    kept = _np(m) > 0
    m2 = (old - behav) ** 2
    assert m2[kept].mean() <= 0.03 + 1e-7
    dropped = (mask > 0) & ~kept
    assert dropped.any() and m2[dropped].min() >= m2[kept].max()


@pytest.mark.parametrize("name", C.CORRECTION_NAMES)
@pytest.mark.parametrize("loss_name", C.POLICY_LOSS_NAMES)
def test_behaviour_equal_policy_means_no_correction(name, loss_name):
    rng = np.random.default_rng(3)
    logp = rng.normal(size=(3, 6)).astype(F) - 2
    mask = (rng.random((3, 6)) > 0.3).astype(F)
    adv = rng.normal(size=(3,)).astype(F)
    w, m, st = A.CORRECTIONS.get(name)(logp, logp, mask, cap=2.0, m2_tau=0.01)
    np.testing.assert_array_equal(_np(w)[mask > 0], 1.0)
    np.testing.assert_array_equal(_np(m), _np(mask))
    assert float(st["masked_token_frac"]) == 0.0
    fn = A.POLICY_LOSSES.get(loss_name)
    nt, ns = A.batch_counts(mask)

    def loss(lp, weight, msk):
        l, _ = fn(lp, jax.lax.stop_gradient(lp), adv, msk, **KW)
        return A.token_mean(l * weight, msk, num_tokens=nt, num_seqs=ns, norm_len=6)

    (l0, g0), (l1, g1) = (
        jax.value_and_grad(loss)(logp, 1.0, mask),
        jax.value_and_grad(loss)(logp, w, m),
    )
    assert float(l0) == float(l1)
    np.testing.assert_array_equal(_np(g0), _np(g1))


def test_corrections_jit_equals_no_jit():
    rng = np.random.default_rng(4)
    behav = rng.normal(size=(2, 5)).astype(F) - 2
    old = behav + rng.normal(scale=0.5, size=(2, 5)).astype(F)
    mask = (rng.random((2, 5)) > 0.2).astype(F)
    for name in C.CORRECTION_NAMES:
        fn = A.CORRECTIONS.get(name)
        eager = fn(old, behav, mask, cap=2.0, m2_tau=0.05)
        jitted = jax.jit(lambda o, b, m, fn=fn: fn(o, b, m, cap=2.0, m2_tau=0.05))(old, behav, mask)
        jax.tree.map(
            lambda a, b: np.testing.assert_allclose(_np(a), _np(b), rtol=1e-6), eager, jitted
        )


def test_entropy_from_logits():
    # uniform over 4 -> ln 4; one-hot-ish -> ~0.
    z = np.array([[[0, 0, 0, 0], [100, 0, 0, 0]]], F)
    np.testing.assert_allclose(_np(A.entropy_from_logits(z)), [[math.log(4), 0]], atol=1e-6)
