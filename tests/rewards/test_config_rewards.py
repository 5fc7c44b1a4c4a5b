"""Rewards registered in an experiment file (`--config my_cfg.py`) run isolated, in the killable
worker processes: the workers cannot import the experiment file's module, so the function goes to
them by value (cloudpickle)."""

from __future__ import annotations

import os

import pytest

from jaxrl.config import load_config
from jaxrl.rewards.rewards import RewardScorer, RewardSpec, get_reward
from jaxrl.sandbox.workers import KillableWorkers

EXPERIMENT = '''
import os
from jaxrl.config import RunConfig
from jaxrl.rewards.rewards import register_reward

BONUS = 0.5  # a module global the reward reads


def _words(text):
    return len(text.split())


@register_reward("cfg_test_words", overwrite=True)  # isolated=True, the default
def words(prompt, completion, **_):
    return _words(completion) + BONUS


def config():
    @register_reward("cfg_test_pid", overwrite=True)  # registered inside config(): a closure
    def pid(prompt, completion, **_):
        return float(os.getpid())

    return RunConfig(name="my_cfg")
'''


@pytest.fixture(scope="module")
def workers():
    with KillableWorkers(1) as w:  # no preload: starts in well under a second
        yield w


def test_isolated_reward_from_an_experiment_file_runs_in_a_worker(tmp_path, workers):
    path = tmp_path / "my_cfg.py"
    path.write_text(EXPERIMENT)
    assert load_config(path).name == "my_cfg"
    assert get_reward("cfg_test_words").isolated and get_reward("cfg_test_pid").isolated
    spec = RewardSpec.from_weights({"cfg_test_words": 1.0, "cfg_test_pid": 0.0})
    items = [{"prompt": "q", "completion": "one two three"}, {"prompt": "q", "completion": "x"}]
    with RewardScorer(spec, workers=workers) as scorer:
        out = scorer.score_batch(items)
    assert out.errors == {"cfg_test_words": 0, "cfg_test_pid": 0}
    assert out.components["cfg_test_words"] == [3.5, 1.5]  # 3 words + 0.5, 1 word + 0.5
    (worker_pid,) = set(out.components["cfg_test_pid"])  # one worker scored both items
    assert worker_pid in workers.pids() and worker_pid != os.getpid()
