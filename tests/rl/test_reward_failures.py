"""A reward that fails on most of a step's items stops the run (`RewardFailure`, naming the reward
and its first error) instead of training on zeros; one that fails now and then is counted and the
run goes on. The real `RolloutProducer` and `RewardScorer`, with a stand-in scheduler, prompts and
tokenizer (no model): milliseconds."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from jaxrl.config import ConfigError
from jaxrl.generate.scheduler import Completion
from jaxrl.rewards.rewards import RewardScorer, RewardSpec, register_reward
from jaxrl.rl import rollout
from jaxrl.rl.rollout import ProducerConfig, RewardFailure, RolloutProducer, reward_metrics

PROMPTS, GROUP = 2, 4  # 8 items a step; sample i of each group completes as the text "s<i>"


@register_reward("test_rf_always", overwrite=True, isolated=False)
def _always(prompt, completion, **_):
    raise RuntimeError("a broken reward")


@register_reward("test_rf_some", overwrite=True, isolated=False)
def _some(prompt, completion, *, fail_samples=(), **_):
    if int(completion[1:]) in fail_samples:
        raise ValueError(f"cannot score {completion}")
    return 1.0


class Scheduler:
    """Completes each request at once: sample i's tokens spell "s<i>"."""

    stats = SimpleNamespace(metrics=dict)

    def __init__(self):
        self._done, self._requests = [], 0

    def set_params(self, params, version):
        pass

    def reset_stats(self):
        pass

    def submit(self, prompt, sampling):
        rid, self._requests = self._requests, self._requests + 1
        for i in range(sampling.n):
            tokens = [ord(ch) for ch in f"s{i}"]
            self._done.append(Completion(rid, i, list(prompt), tokens, [0.0] * len(tokens),
                                         [0] * len(tokens), "stop"))
        return rid

    def has_work(self):
        return bool(self._done)

    def step(self):
        done, self._done = self._done, []
        return done


class Prompts:
    consumed, epochs = 0, 0

    def __next__(self):
        self.consumed += 1
        return [{"uid": f"u{i}", "prompt": "p"} for i in range(PROMPTS)]

    def metrics(self):
        return {}


def _produce(scorer):
    task = SimpleNamespace(
        render=lambda record, tokenizer, fmt: [1, 2],
        reward_items=lambda recs, texts: [{**r, "completion": t}
                                          for r, t in zip(recs, texts, strict=True)])
    tokenizer = SimpleNamespace(decode=lambda ids, errors: "".join(map(chr, ids)))
    cfg = ProducerConfig(prompts_per_step=PROMPTS, group_size=GROUP, max_new_tokens=4,
                         filter_zero_variance=False, max_oversample_rounds=0)
    producer = RolloutProducer(task=task, tokenizer=tokenizer, prompts=Prompts(), scorer=scorer,
                               cfg=cfg)
    return producer.produce(0, Scheduler(), lambda: ("params", 0))


def test_a_reward_failing_on_every_item_stops_naming_it_and_its_error():
    spec = RewardSpec.from_weights({"test_rf_some": 1.0, "test_rf_always": 0.5})
    with RewardScorer(spec) as scorer, pytest.raises(RewardFailure) as info:
        _produce(scorer)
    msg = str(info.value)
    assert "reward 'test_rf_always' failed on 8 of the 8 items of step 0" in msg, msg
    assert "first error: RuntimeError: a broken reward" in msg, msg
    assert "MAX_REWARD_FAILURE_FRAC=0.5" in msg, msg
    assert isinstance(info.value, ConfigError)  # launch/run.py prints it as one line, exit 2


@pytest.mark.parametrize("fail_samples", [(3,), (2, 3), (1, 2, 3)])
def test_some_failures_are_counted_up_to_the_threshold(fail_samples):
    # 2 prompts x 4 samples: failing samples (3,) = 2 of 8 items, (2, 3) = 4 of 8 (exactly the
    # threshold, not past it), (1, 2, 3) = 6 of 8 (past it: the run stops)
    assert rollout.MAX_REWARD_FAILURE_FRAC == 0.5
    spec = RewardSpec.from_weights({"test_rf_some": 1.0},
                                   options={"test_rf_some": {"fail_samples": fail_samples}})
    failed = PROMPTS * len(fail_samples)
    with RewardScorer(spec) as scorer:
        if failed > 4:
            with pytest.raises(RewardFailure, match=r"6 of the 8 items.*ValueError: cannot score"):
                _produce(scorer)
            return
        produced = _produce(scorer)
        row = reward_metrics(None, scorer)
    rewards = [r.reward for g in produced.groups for r in g.rollouts]
    assert rewards == [0.0 if i in fail_samples else 1.0 for _ in range(PROMPTS)
                       for i in range(GROUP)]
    assert produced.metrics["reward/test_rf_some/errors"] == failed
    assert produced.metrics["reward/mean"] == pytest.approx(1 - failed / 8)
    assert row["reward/test_rf_some/errors_total"] == failed
    assert row["sandbox/timeouts"] == 0 and row["sandbox/restart_failures"] == 0  # no pool
