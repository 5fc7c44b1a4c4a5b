"""A short run learns: the full loop (generator, scorer, trainer, weight sync) raises reward."""

import dataclasses

import numpy as np
import pytest
from run_helpers import contains_x, tiny_run_config

import jaxrl.run
from jaxrl.data import tasks
from jaxrl.rewards.rewards import register_reward


@pytest.mark.slow
def test_periodic_run_raises_reward(tmp_path, monkeypatch):
    register_reward("test_contains_x", isolated=False, overwrite=True)(contains_x)
    real = tasks.build_task
    monkeypatch.setattr(tasks, "build_task", lambda cfg: dataclasses.replace(
        real(cfg), rewards={"test_contains_x": 1.0}, reward_options={}))
    cfg = tiny_run_config(tmp_path, name="learn", pipeline=dict(mode="periodic", steps=20),
                          train=dict(lr=5e-3, checkpoint_every=0),
                          data=dict(prompts_per_step=8, group_size=8, max_new_tokens=8))
    result = jaxrl.run.run(cfg, progress=False, evaluate=False)
    produced = [h["reward/produced_mean"] for h in result.history]
    first, last = np.mean(produced[:3]), np.mean(produced[-3:])
    assert last > first + 0.2, produced
