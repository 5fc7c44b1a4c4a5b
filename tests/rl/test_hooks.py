"""Hooks see the step's completed row and return what they add: their order does not matter,
none sees another's additions, and two hooks adding one column is an error."""

import random

import pytest
from fake_loop import batch, fake_loop

from jaxrl.rl.hooks import Hook

TIMING = ("pipeline/step_s", "pipeline/trainer_idle_frac", "pipeline/generator_idle_frac",
          "pipeline/rollouts_per_s_consumed", "pipeline/rollouts_per_s_produced",
          "pipeline/generator_busy_s", "pipeline/trainer_busy_s")


def _rows(hooks, steps=6):
    rows = []
    loop = fake_loop("periodic", produce=lambda step, weights: batch(step, weights()[1]),
                     train=lambda step, produced: ({"loss/total": 1.0 / (step + 1)}, step + 1),
                     publish=lambda params, version: (params, {}), hooks=hooks, rows=rows)
    loop.run(start_step=0, num_steps=steps, first_row={"eval/pass@1": 0.25})
    return [{k: v for k, v in r.items() if k not in TIMING} for r in rows]


def _hooks():
    def loss_seen(record):  # the trainer's metrics of this very step are in the row
        return {"hook/loss_seen": record.row["loss/total"]}

    def keys_seen(record):  # no hook sees another's columns
        return {"hook/keys_seen": float(sum(k.startswith("hook/") for k in record.row))}

    def every_other(record):
        return {"hook/steps_done": float(record.steps_done)}

    def at_end(record):
        return {"hook/end": float(record.end)}

    return [Hook(loss_seen), Hook(keys_seen), Hook(every_other, every=2),
            Hook(at_end, every=0)]


def test_hooks_in_shuffled_order_give_identical_rows():
    reference = _rows(_hooks())
    for seed in range(3):
        hooks = _hooks()
        random.Random(seed).shuffle(hooks)
        assert _rows(hooks) == reference
    assert [r["hook/loss_seen"] for r in reference] == [1.0 / (s + 1) for s in range(6)]
    assert all(r["hook/keys_seen"] == 0.0 for r in reference)
    assert [r.get("hook/steps_done") for r in reference] == [None, 2.0, None, 4.0, None, 6.0]
    assert [r.get("hook/end") for r in reference] == [None] * 5 + [1.0]
    assert reference[0]["eval/pass@1"] == 0.25 and "eval/pass@1" not in reference[1]


def test_two_hooks_adding_one_column_is_an_error():
    twice = [Hook(lambda record: {"hook/x": 1.0}), Hook(lambda record: {"hook/x": 2.0})]
    with pytest.raises(ValueError, match="hook/x"):
        _rows(twice, steps=1)
    with pytest.raises(ValueError, match="loss/total"):  # nor may a hook overwrite the row's
        _rows([Hook(lambda record: {"loss/total": 0.0})], steps=1)
