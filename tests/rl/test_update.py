"""The update verb (jaxrl/rl/update.py) on hand-made groups and a stand-in trainer: the staleness
bound of the pipeline config reaches the batch the trainer sees. (This replaced a whole periodic
run with `max_staleness=0, stale_policy=downweight`; that periodic data is one version old is
shown by the mode matrix's staleness checks in test_run.py.)"""

import types

import numpy as np
import pytest

from jaxrl.config.sections import PipelineConfig
from jaxrl.rl.buffer import Group, Rollout
from jaxrl.rl.rollout import Produced
from jaxrl.rl.update import Update


def _group(version, index):
    rollouts = [Rollout(prompt=[5, 6], completion=[10 + i, 11], logprobs=[-0.5, -0.25],
                        versions=[version, version], reward=float(i)) for i in range(2)]
    return Group(example={"index": index}, rollouts=rollouts)


class _Trainer:
    def __init__(self):
        self.seen = []

    def step(self, batch, *, seed_step):
        self.seen.append((seed_step, np.asarray(batch.sample_weights)))
        return {"loss/total": 1.0}


class _DataStates:
    def __init__(self):
        self.committed = []

    def commit(self, step):
        self.committed.append(step)


def _update(**pipe):
    processes = types.SimpleNamespace(global_groups=lambda groups: groups)
    data_states = _DataStates()
    return Update(PipelineConfig(**pipe), processes, data_states), data_states


def _produced(step, versions):
    groups = [_group(v, i) for i, v in enumerate(versions)]
    return Produced(step=step, groups=groups, num_rollouts=2 * len(groups),
                    num_tokens=8 * len(groups), busy_s=0.0, min_version=min(versions),
                    metrics={"reward/mean": 0.5})


def test_periodic_data_beyond_a_zero_bound_is_downweighted_not_dropped():
    update, data_states = _update(mode="periodic", max_staleness=0, stale_policy="downweight",
                                  stale_weight=0.5)
    trainer = _Trainer()
    # step 0 is generated from the initial weights (version 0); step 1 one version old
    first = update(0, _produced(0, [0, 0]), trainer)
    second = update(1, _produced(1, [0, 1]), trainer)
    assert (first["staleness/downweighted_groups"], second["staleness/downweighted_groups"]) == (
        0.0, 1.0)
    assert first["staleness/dropped_groups"] == second["staleness/dropped_groups"] == 0.0
    (s0, w0), (s1, w1) = trainer.seen
    assert (s0, s1) == (0, 1)  # the trainer's randomness follows the pipeline step
    np.testing.assert_array_equal(w0, [1, 1, 1, 1])
    np.testing.assert_array_equal(w1, [0.5, 0.5, 1, 1])  # the old group's two rows, 0.5 ** 1
    assert second["pipeline/batch_size"] == 4.0 and second["reward/mean"] == 0.5
    assert second["loss/total"] == 1.0 and second["staleness/max"] == 1.0
    assert data_states.committed == [0, 1]  # what a checkpoint saves: the data trained on


def test_drop_removes_the_groups_past_the_bound_and_never_trains_on_nothing():
    update, _ = _update(mode="async", max_staleness=1, stale_policy="drop")
    trainer = _Trainer()
    metrics = update(3, _produced(3, [1, 2, 3]), trainer)
    assert metrics["staleness/dropped_groups"] == 1.0 and metrics["pipeline/batch_size"] == 6.0
    np.testing.assert_array_equal(trainer.seen[0][1], [1, 1, 1, 1])  # two groups left
    with pytest.raises(RuntimeError, match="every group exceeded the staleness bound 1"):
        update(5, _produced(5, [1, 2]), trainer)
