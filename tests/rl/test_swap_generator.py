"""Loop.swap_parts, the safe point of a live move, with fakes: the generator replaced mid-run
loses no batch and makes none twice, and every batch started after the swap is made by the new
generator with the weights the swap published; in sync mode the batch after the move's step is
the new generator's."""

import dataclasses
import time
from types import SimpleNamespace

import pytest
from fake_loop import fake_loop

from jaxrl.rl.rollout import Produced


class _Move:
    """A live move at step 3 (what `LiveRebalance` returns to the loop)."""

    def plan(self, record, parts=None):
        if record.step != 3:
            return {}, None

        def build(parts, version):  # rebuild "on other devices": same version, new params
            engine = SimpleNamespace(params=SimpleNamespace(state=f"moved-w{version}"))
            generator = SimpleNamespace(publisher=parts.generator.publisher, scheduler="new",
                                        engine=engine)
            return dataclasses.replace(parts, generator=generator)

        return {}, build

    def moved(self, seconds):
        return {"rebalance/move_s": seconds}


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_swap_mid_run_loses_and_repeats_no_batch(mode):
    made, trained, rows = [], [], []

    def train(step, produced):
        trained.append((step, *produced.groups))
        return {}, f"w{step + 1}"

    loop = fake_loop(mode, max_staleness=2, produce=None, train=train, initial_params="w0",
                     publish=lambda params, version: (params, {}), poll_s=0.005, rows=rows,
                     rebalance=_Move())

    def produce(step, scheduler, weights):
        params, version = weights()
        time.sleep(0.01)
        made.append(step)
        return Produced(step, [scheduler or "old", params], 1, 1, 0.01, version)

    loop.rollouts.produce = produce
    loop.run(start_step=0, num_steps=8)
    assert sorted(made) == list(range(8)) and [t[0] for t in trained] == list(range(8))
    assert "rebalance/move_s" in rows[3]
    after = [t for t in trained if t[1] == "new"]
    assert after and all(t[0] > 3 for t in after)  # batches made before the swap stay queued
    assert {t[2] for t in after} <= {"moved-w4", "w5", "w6", "w7"}
    if mode == "sync":  # batch 4 waits for step 3's decision: made after the move, not
        # by the old generator with the swap waiting for it
        assert trained[4][1:] == ("new", "moved-w4")
        assert [t[1:] for t in trained[5:]] == [("new", "w5"), ("new", "w6"), ("new", "w7")]
