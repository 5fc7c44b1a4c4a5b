import numpy as np
import pytest

from jaxrl.rl.buffer import (
    Group,
    Rollout,
    RolloutBuffer,
    apply_staleness_bound,
    groups_to_batch,
    staleness_stats,
)


def _group(rewards, version=0, prompt=(5, 6, 7), index=0):
    rollouts = [
        Rollout(prompt=list(prompt), completion=[10 + i, 11], logprobs=[-0.5, -0.25],
                versions=[version, version + 1], reward=r)
        for i, r in enumerate(rewards)
    ]
    return Group(example={"index": index}, rollouts=rollouts)


def test_zero_variance_groups_are_filtered_and_counted():
    buf = RolloutBuffer()
    assert not buf.add(_group([1.0, 1.0, 1.0]))
    assert not buf.add(_group([0.0, 0.0]))
    assert buf.add(_group([0.0, 1.0]))
    assert len(buf) == 1 and buf.counters.zero_variance == 2 and buf.counters.groups_added == 3
    keep_all = RolloutBuffer(filter_zero_variance=False)
    assert keep_all.add(_group([1.0, 1.0]))


def test_staleness_bound_drops_or_downweights():
    groups = [_group([0.0, 1.0], version=v, index=v) for v in (0, 1, 2, 3)]
    kept, dropped, _ = apply_staleness_bound(groups, 3, max_staleness=1)
    # min versions 0,1,2,3 -> staleness 3,2,1,0: only the last two fit a bound of 1
    assert [g.example["index"] for g in kept] == [2, 3] and dropped == 2
    assert all(3 - g.min_version <= 1 for g in kept)
    (g,), _, down = apply_staleness_bound([_group([0.0, 1.0], version=0)], 3, max_staleness=1,
                                          policy="downweight", weight=0.5)
    assert g.weight == 0.25 and down == 1


def test_buffer_takes_oldest_first_and_keeps_nothing_stale():
    buf = RolloutBuffer()
    for i in range(3):
        buf.add(_group([0.0, 1.0], index=i))
    assert [g.example["index"] for g in buf.take(2)] == [0, 1]
    assert [g.example["index"] for g in buf.take(5)] == [2] and len(buf) == 0
    assert buf.counters.groups_taken == 3


def test_staleness_stats_are_token_weighted():
    groups = [_group([0.0, 1.0], version=2)]  # token versions 2 and 3 in each of two rows
    assert staleness_stats(groups, trainer_version=3) == {"staleness/mean": 0.5,
                                                          "staleness/max": 1.0}


def test_groups_to_batch_layout_and_alignment():
    g1 = _group([0.0, 1.0], prompt=(5, 6, 7))
    g2 = _group([1.0, 0.5], prompt=(8,))
    batch = groups_to_batch([g1, g2])
    assert batch.shape == (4, 5)
    np.testing.assert_array_equal(batch.tokens[0], [5, 6, 7, 10, 11])
    np.testing.assert_array_equal(batch.tokens[2], [8, 10, 11, 0, 0])
    np.testing.assert_array_equal(batch.loss_mask[2], [0, 1, 1, 0, 0])
    np.testing.assert_array_equal(batch.segment_ids[2], [1, 1, 1, 0, 0])
    np.testing.assert_allclose(batch.behaviour_logprobs[0], [0, 0, 0, -0.5, -0.25])
    np.testing.assert_array_equal(batch.versions[0], [0, 0, 0, 0, 1])
    np.testing.assert_array_equal(batch.group_ids, [0, 0, 1, 1])
    np.testing.assert_allclose(batch.rewards, [0.0, 1.0, 1.0, 0.5])
    bad = _group([0.0, 1.0])
    bad.rollouts[0].logprobs = [-1.0]
    with pytest.raises(ValueError, match="2 completion tokens but 1 logprobs"):
        groups_to_batch([bad])


def test_apply_staleness_bound_and_batch_weights():
    groups = [_group([0.0, 1.0], version=v, index=v) for v in (0, 2, 3)]
    # trainer version 3, bound 1: staleness 3, 1, 0 -> only the first exceeds, by 2 versions
    kept, dropped, down = apply_staleness_bound(groups, 3, max_staleness=1, policy="drop")
    assert [g.example["index"] for g in kept] == [2, 3] and (dropped, down) == (1, 0)
    kept, dropped, down = apply_staleness_bound(
        groups, 3, max_staleness=1, policy="downweight", weight=0.5
    )
    assert [g.weight for g in kept] == [0.25, 1.0, 1.0] and (dropped, down) == (0, 1)
    np.testing.assert_allclose(groups_to_batch(kept).sample_weights, [0.25] * 2 + [1.0] * 4)
    assert apply_staleness_bound(groups, 9, max_staleness=None)[0] == groups
