"""Several updates per batch (`train.mini_batches` x `train.epochs`): the plan keeps groups
whole and shuffles per epoch; the trainer equals a hand-written loop; clipping acts from the
second update on."""

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl.config import TrainConfig
from jaxrl.train.batch import make_batch
from jaxrl.train.minibatch import plan_updates
from jaxrl.train.step import batch_shardings, make_train_step
from jaxrl.train.trainer import Trainer


def _batch(seed=0, groups=8, n=4, t=16, prompt=5, vocab=128):
    """`groups` groups of `n` rows whose rewards vary within each group."""
    rng = np.random.default_rng(seed)
    b = groups * n
    tokens = rng.integers(1, vocab, (b, t))
    lengths = rng.integers(prompt + 3, t + 1, b)
    pos = np.arange(t)[None, :]
    seg = (pos < lengths[:, None]).astype(np.int32)
    mask = ((pos >= prompt) & (pos < lengths[:, None])).astype(np.float32)
    rewards = np.tile(np.arange(n) / (n - 1), groups).astype(np.float32)
    return make_batch(tokens, mask, rewards, np.repeat(np.arange(groups), n), segment_ids=seg)


def test_plan_keeps_groups_whole_and_shuffles_each_epoch():
    gid = np.repeat(np.arange(6), 3)
    valid = np.ones(18, bool)
    valid[-3:] = False  # the last group is padding
    plan = plan_updates(gid, valid, mini_batches=2, epochs=2, seed=(0, 7), row_multiple=2)
    assert len(plan.updates) == 4 and plan.rows == 10  # 3 groups of 3 rows, rounded up to 2
    for epoch in (plan.updates[:2], plan.updates[2:]):
        rows = np.concatenate([idx for idx, _ in epoch])
        assert sorted(rows.tolist()) == list(range(15))  # every real row once per epoch
        for idx, new_gid in epoch:
            for g in set(gid[idx].tolist()):  # a group is whole, renumbered consecutively
                assert len(set(new_gid[gid[idx] == g].tolist())) == 1
                assert (gid[idx] == g).sum() == 3
    orders = [tuple(gid[idx][::3]) for idx, _ in plan.updates]
    assert orders[:2] != orders[2:]  # seeded shuffle differs between the epochs
    again = plan_updates(gid, valid, mini_batches=2, epochs=2, seed=(0, 7), row_multiple=2)
    assert all((a[0] == b[0]).all() for a, b in zip(plan.updates, again.updates, strict=True))
    with pytest.raises(ValueError, match="mini_batches=6 is more than the batch's 5 groups"):
        plan_updates(gid, valid, mini_batches=6, epochs=1, seed=(0,))


@pytest.fixture(scope="module")
def several(model_cfg, mesh):
    cfg = TrainConfig(lr=5e-2, logprob_chunk=8, weight_decay=0.0, mini_batches=4, epochs=2,
                      eps_low=0.02, eps_high=0.02)
    batch = _batch()
    trainer = Trainer(model_cfg, cfg, mesh)
    params0 = jax.device_get(trainer.state.params)
    trainer.step(batch, seed_step=3)
    return cfg, batch, params0, trainer


def test_clipping_acts_from_the_second_update(several):
    _, _, _, trainer = several
    clip = [u["policy/clip_frac"] for u in trainer.last_updates]
    assert len(clip) == 8 and clip[0] == 0.0  # on-policy: the ratio is 1 at the first update
    assert all(c > 0 for c in clip[1:]), clip
    assert trainer.last_updates[-1]["train/step"] == 8


def test_trainer_equals_a_hand_written_loop(several, model_cfg, mesh):
    cfg, batch, params0, trainer = several
    one = dataclasses.replace(cfg, mini_batches=1, epochs=1)
    ref = Trainer(model_cfg, one, mesh, params=params0)
    full = ref.prepare(batch)
    old = np.asarray(ref.logprobs(ref.state.params, full))  # pi_old, once, before any update
    step = make_train_step(ref.graphdef, cfg, mesh, ref.shardings)
    plan = plan_updates(batch.group_ids, np.ones(batch.shape[0], bool), mini_batches=4, epochs=2,
                        seed=(cfg.seed, 3), row_multiple=ref.row_multiple)
    host = jax.device_get(full)
    state = ref.state
    for idx, new_gid in plan.updates:  # plain numpy slicing, no padding needed (8 rows each)
        mb = dataclasses.replace(
            jax.tree.map(lambda x, idx=idx: None if x is None else np.asarray(x)[idx], host),
            group_ids=new_gid, proximal_logprobs=old[idx])
        state, _ = step(state, jax.device_put(mb, batch_shardings(mb, mesh)))
    got, want = jax.device_get(trainer.state.params), jax.device_get(state.params)
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want), strict=True):
        np.testing.assert_allclose(a, b, rtol=0, atol=1e-6)
    moved = max(float(np.abs(a - b).max()) for a, b in zip(jax.tree.leaves(got),
                                                         jax.tree.leaves(params0), strict=True))
    assert moved > 1e-3  # the updates did something


def test_metrics_are_averaged_with_the_last_update(several):
    from jaxrl.train.minibatch import combine_update_metrics

    _, _, _, trainer = several
    row = combine_update_metrics(trainer.last_updates)
    losses = [u["loss/total"] for u in trainer.last_updates]
    assert row["loss/total"] == pytest.approx(np.mean(losses))
    assert row["last/loss/total"] == losses[-1] and row["train/updates"] == 8
