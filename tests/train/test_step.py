"""The jitted train step: micro-batching, jit == eager, NaN policy, bad inputs, and learning."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.train.batch import BatchError, make_batch
from jaxrl.train.config import TrainConfig
from jaxrl.train.objective import prepare_targets
from jaxrl.train.state import init_train_state, model_graphdef
from jaxrl.train.step import _grads_and_stats, batch_shardings
from jaxrl.train.trainer import NonFiniteError, Trainer

# seq_mean_token_mean + truncated IS: the normalisers and IS weights are the parts that
# micro-batching could get wrong.
MICRO_CFG = TrainConfig(aggregation="seq_mean_token_mean", correction="tis_token", logprob_chunk=8)


@pytest.fixture(scope="module")
def grads_setup(model_cfg, mesh, make_toy):
    batch = make_toy(seed=0, b=8, behaviour=True)
    # every row's positions restart at a different point (RoPE only sees relative positions, so
    # a per-row shift would not do): the step computes the rotary tables for the whole batch and
    # splits them with the rows, and this catches them misaligned (checked by reversing them)
    t = np.arange(batch.tokens.shape[1])[None, :]
    cut = 3 + np.arange(batch.tokens.shape[0])[:, None]
    batch = dataclasses.replace(batch, positions=np.where(t < cut, t, t - cut).astype(np.int32))
    graphdef, _ = model_graphdef(model_cfg, MICRO_CFG)
    params = init_train_state(model_cfg, MICRO_CFG, mesh).params
    batch = jax.device_put(batch, batch_shardings(batch, mesh))

    def grads(params, batch, cfg):
        tg, _ = prepare_targets(cfg, batch)
        return _grads_and_stats(params, batch, tg, graphdef=graphdef, cfg=cfg)

    jitted = {}
    for m in (1, 4):
        cfg = dataclasses.replace(MICRO_CFG, micro_batches=m)
        jitted[m] = jax.device_get(jax.jit(grads, static_argnums=2)(params, batch, cfg))
    return grads, params, batch, jitted


def _assert_same(a, b, rtol, atol):
    (ga, sa), (gb, sb) = a, b
    close = lambda x, y: np.testing.assert_allclose(x, y, rtol=rtol, atol=atol)
    jax.tree.map(close, ga, gb)
    assert sa.keys() == sb.keys()
    for k in sa:
        np.testing.assert_allclose(sa[k], sb[k], rtol=rtol, atol=atol, err_msg=k)


def test_micro_batched_grads_equal_full_batch(grads_setup):
    # The sums run in a different order, so gradients agree to f32 rounding: rtol 1e-5
    # (observed ~1e-6), atol 1e-7 for entries near 0.
    _, _, _, jitted = grads_setup
    _assert_same(jitted[1], jitted[4], rtol=1e-5, atol=1e-7)


def test_jit_equals_no_jit(grads_setup):
    # The micro-batched (lax.scan) gradient, run op by op vs compiled: same f32 maths, different
    # fusion; tolerance as above.
    grads, params, batch, jitted = grads_setup
    cfg = dataclasses.replace(MICRO_CFG, micro_batches=4)
    with jax.disable_jit():
        eager = jax.device_get(grads(jax.device_get(params), jax.device_get(batch), cfg))
    _assert_same(jitted[4], eager, rtol=1e-5, atol=1e-7)


@pytest.mark.parametrize("policy", ["stop", "skip"])
def test_nonfinite_update_is_never_applied(model_cfg, mesh, train_cfg, make_toy, policy):
    tr = Trainer(model_cfg, dataclasses.replace(train_cfg, nan_policy=policy), mesh)
    params = jax.tree.map(lambda x: x, tr.state.params)
    params["final_norm"]["weight"] = params["final_norm"]["weight"].at[0].set(jnp.nan)
    tr.replace_state(tr.state.replace(params=params))
    before = jax.device_get(tr.state.params)
    if policy == "stop":
        with pytest.raises(NonFiniteError, match="nan_policy='skip'"):
            tr.step(make_toy(seed=5))
    else:
        assert tr.step(make_toy(seed=5))["train/nonfinite"] == 1
        assert int(tr.state.nonfinite_skips) == 1 and int(tr.state.step) == 0
    same = lambda a, b: np.testing.assert_array_equal(a, b)
    jax.tree.map(same, before, jax.device_get(tr.state.params))


def test_missing_behaviour_logprobs_is_a_clear_error(model_cfg, mesh, make_toy):
    tr = Trainer(model_cfg, TrainConfig(correction="tis_token", logprob_chunk=8), mesh)
    with pytest.raises(ValueError, match="needs the generator's behaviour logprobs"):
        tr.step(make_toy(seed=6, behaviour=False))


def test_bad_batches_are_clear_errors():
    t = np.zeros((2, 4), np.int32)
    m = np.array([[0, 0, 1, 1], [0, 1, 1, 0]], np.float32)
    g = np.zeros(2, np.int32)
    with pytest.raises(BatchError, match=r"loss_mask has shape \(2, 3\); expected \(2, 4\)"):
        make_batch(t, m[:, :3], np.zeros(2), g)
    with pytest.raises(BatchError, match=r"rewards has shape \(3,\); expected \(2,\)"):
        make_batch(t, m, np.zeros(3), g)
    with pytest.raises(BatchError, match="position 0"):
        make_batch(t, np.ones((2, 4)), np.zeros(2), g)
    with pytest.raises(BatchError, match=r"group_ids must lie in \[0, B=2\)"):
        make_batch(t, m, np.zeros(2), np.array([0, 5]))
    with pytest.raises(BatchError, match="group_ids must be integer"):
        make_batch(t, m, np.zeros(2), np.zeros(2))
    with pytest.raises(BatchError, match="behaviour_logprobs has shape"):
        make_batch(t, m, np.zeros(2), g, behaviour_logprobs=np.zeros((2, 5)))
    with pytest.raises(BatchError, match="padding position"):
        make_batch(t, m, np.zeros(2), g, segment_ids=np.array([[1, 1, 1, 0]] * 2))


def _answer_logits(trainer, prompt):
    model = nnx.merge(trainer.graphdef, trainer.state.params)
    return model(jnp.asarray(prompt[None]))[0, -1]


def test_grpo_learns_a_token_bandit(model_cfg, mesh, train_cfg):
    """A real learning signal: one-token answers to a fixed 15-token prompt, reward 1 for
    tokens < 16 (probability ~1/8 at init). Answers are sampled from the current policy, scored
    and trained on with GRPO (2 groups of 4); the rewarded probability mass must rise well above
    chance."""
    tr = Trainer(model_cfg, train_cfg, mesh)
    prompt = (np.arange(15) * 7 % 128).astype(np.int32)
    p0 = float(jnp.sum(jax.nn.softmax(_answer_logits(tr, prompt))[:16]))
    for step in range(15):
        key = jax.random.fold_in(jax.random.key(0), step)
        answers = np.asarray(jax.random.categorical(key, _answer_logits(tr, prompt), shape=(8,)))
        tokens = np.concatenate([np.tile(prompt, (8, 1)), answers[:, None]], axis=1)
        mask = np.zeros(tokens.shape, np.float32)
        mask[:, -1] = 1
        rewards = (answers < 16).astype(np.float32)
        tr.step(make_batch(tokens, mask, rewards, np.repeat(np.arange(2), 4)))
    p1 = float(jnp.sum(jax.nn.softmax(_answer_logits(tr, prompt))[:16]))
    assert p1 > max(3 * p0, 0.5), f"rewarded probability went {p0:.3f} -> {p1:.3f}"


def test_decoupled_and_kl_with_behaviour_equal_policy(model_cfg, mesh, train_cfg, make_toy):
    """Trainer.prepare fills pi_prox (decoupled PPO) and pi_ref (KL) on the trainer mesh. With
    behaviour == reference == current policy, every IS weight is 1, KL is 0, and the loss equals
    the uncorrected one."""
    import dataclasses as dc

    plain = Trainer(model_cfg, train_cfg, mesh)
    batch = make_toy(seed=7)
    own = np.asarray(plain.logprobs(plain.state.params, plain.prepare(batch)))[:8, :16]
    cfg = dc.replace(train_cfg, correction="decoupled", kl_coef=0.1)
    with pytest.raises(ValueError, match="needs ref_params"):
        Trainer(model_cfg, cfg, mesh)
    corrected = Trainer(model_cfg, cfg, mesh, ref_params=plain.state.params)
    m_c = corrected.step(batch.replace(behaviour_logprobs=own * np.asarray(batch.loss_mask)))
    m_p = plain.step(batch)
    assert m_c["is/weight_mean"] == pytest.approx(1.0, abs=1e-6)
    assert m_c["is/weight_max"] == pytest.approx(1.0, abs=1e-6)
    assert m_c["is/masked_token_frac"] == 0.0
    assert m_c["loss/kl"] == pytest.approx(0.0, abs=1e-7)
    assert m_c["loss/policy"] == pytest.approx(m_p["loss/policy"], rel=1e-5, abs=1e-7)
    assert m_c["train/grad_norm"] == pytest.approx(m_p["train/grad_norm"], rel=1e-4)


@pytest.mark.slow
@pytest.mark.parametrize("remat", ["full", "dots"])
def test_remat_does_not_change_gradients(grads_setup, model_cfg, remat):
    grads, params, batch, jitted = grads_setup
    cfg = dataclasses.replace(MICRO_CFG, remat=remat)
    graphdef, _ = model_graphdef(model_cfg, cfg)

    def f(params, batch):
        tg, _ = prepare_targets(cfg, batch)
        return _grads_and_stats(params, batch, tg, graphdef=graphdef, cfg=cfg)

    _assert_same(jitted[1], jax.device_get(jax.jit(f)(params, batch)), rtol=1e-5, atol=1e-7)


def test_padded_lengths_follow_the_buckets_and_padding_changes_nothing(model_cfg, mesh,
                                                                       train_cfg, make_toy):
    from jaxrl.train.batch import pad_batch, padded_shape

    lengths = [padded_shape(3, t, row_multiple=4, min_len=16)
               for t in (1, 16, 17, 24, 25, 33, 44, 49, 65, 97, 129, 200)]
    assert [r for r, _ in lengths] == [4] * 12
    # 1.5x steps up to 4 x min_len, then eight buckets per octave (multiples of 8 up to 128,
    # of 16 up to 256)
    assert [n for _, n in lengths] == [16, 16, 24, 24, 32, 48, 48, 64, 72, 104, 144, 208]
    assert [padded_shape(1, t, row_multiple=1, min_len=16)[1] for t in (104, 128, 129)] == [
        104, 128, 144]
    assert padded_shape(8, 100, row_multiple=1, min_len=16, max_len=102) == (8, 102)
    with pytest.raises(BatchError, match="exceeds"):
        padded_shape(8, 120, row_multiple=1, min_len=16, max_len=112)
    # a [8, 20] batch: the trainer pads it to 24; padded to 64 instead, its logprobs agree
    tr = Trainer(model_cfg, train_cfg, mesh)
    batch = make_toy(seed=3, t=20)
    short, long = tr.pad(batch), pad_batch(batch, 8, 64)
    assert short.shape == (8, 24)
    lp = [np.asarray(tr.logprobs(tr.state.params, jax.device_put(b, batch_shardings(b, mesh))))
          for b in (short, long)]
    real = np.asarray(batch.segment_ids) > 0
    np.testing.assert_allclose(lp[0][:, :20][real], lp[1][:, :20][real], rtol=1e-5, atol=1e-5)
