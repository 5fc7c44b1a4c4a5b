"""Per-row sample weights (stale rows kept with a down-weight) scale exactly their rows' loss.

Hand derivation for the default objective (grpo advantages, ppo_clip, token_mean, no correction):
with pi_old = sg(pi) the ratio is exp(logp - sg(logp)) = 1, so each loss token contributes
-adv_b * s_b, and token_mean divides by the number of loss tokens N of the whole batch:

    loss = -(1/N) * sum_b s_b * adv_b * |y_b|,       d loss / d logp[b, t] = -s_b * adv_b / N.
"""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.train.batch import BatchError, make_batch
from jaxrl.train.config import TrainConfig
from jaxrl.train.objective import policy_objective, prepare_targets


def _batch(weights):
    tokens = np.arange(4 * 5, dtype=np.int32).reshape(4, 5)
    mask = np.zeros((4, 5), np.float32)
    mask[:, 2:] = 1.0
    mask[3, 4] = 0.0  # unequal lengths: 3, 3, 3, 2 loss tokens (N = 11)
    rewards = np.asarray([1.0, 0.0, 1.0, 0.0], np.float32)
    return make_batch(tokens, mask, rewards, np.asarray([0, 0, 1, 1]), sample_weights=weights)


def _loss_and_grad(batch, cfg):
    targets, _ = prepare_targets(cfg, batch)
    logp = jnp.asarray(np.random.default_rng(0).normal(size=batch.shape) * 0.1, jnp.float32)

    def loss(lp):
        return policy_objective(cfg, lp, jnp.zeros_like(lp), batch, targets)[0]

    return loss(logp), jax.grad(loss)(logp), np.asarray(targets.adv_B)


def test_weights_scale_their_rows_as_derived():
    cfg = TrainConfig()
    s = np.asarray([0.5, 1.0, 0.25, 1.0], np.float32)
    batch = _batch(s)
    loss, grad, adv = _loss_and_grad(batch, cfg)
    n = batch.loss_mask.sum()
    lengths = batch.loss_mask.sum(-1)
    np.testing.assert_allclose(loss, -(s * adv * lengths).sum() / n, rtol=1e-6)
    np.testing.assert_allclose(grad, -(s * adv)[:, None] * batch.loss_mask / n, rtol=1e-6)


def test_unit_weights_equal_no_weights():
    cfg = TrainConfig()
    with_w = _loss_and_grad(_batch(np.ones(4, np.float32)), cfg)
    without = _loss_and_grad(_batch(None), cfg)
    np.testing.assert_array_equal(with_w[0], without[0])
    np.testing.assert_array_equal(with_w[1], without[1])


def test_bad_weights_are_clear_errors():
    with pytest.raises(BatchError, match=r"sample_weights must lie in \[0, 1\]"):
        _batch(np.asarray([0.5, 2.0, 1.0, 1.0]))
    with pytest.raises(BatchError, match="sample_weights has shape"):
        _batch(np.ones(3))
