"""Pipeline.swap_generator, the safe point of a live move, with fakes: the generator replaced
mid-run loses no batch and makes none twice, and every batch started after the swap is made by
the new generator with the weights the swap published."""

import time

import pytest

from jaxrl.controller.pipeline import Pipeline, Produced


@pytest.mark.parametrize("mode", ["sync", "async"])
def test_swap_mid_run_loses_and_repeats_no_batch(mode):
    gen = {"name": "old"}
    made, trained = [], []

    def produce(step, weights):
        params, version = weights()
        time.sleep(0.01)
        made.append(step)
        return Produced(step, (gen["name"], params), 1, 1, 0.01, version)

    def train(step, produced):
        trained.append((step, *produced.payload))
        return {}, f"w{step + 1}"

    def swap(weights):  # rebuild "on other devices": the same version, new params object
        _, version = weights()
        gen["name"] = "new"
        return f"moved-w{version}", version

    pipe = Pipeline(mode=mode, max_staleness=2, produce=produce, train=train,
                    publish=lambda params, version: (params, {}), poll_s=0.005)
    pipe.run(start_step=0, num_steps=8, initial_params="w0",
             on_step=lambda step, m: pipe.swap_generator(swap) if step == 3 else None)
    assert sorted(made) == list(range(8)) and [t[0] for t in trained] == list(range(8))
    after = [t for t in trained if t[1] == "new"]
    assert after and all(t[0] > 3 for t in after)  # batches made before the swap stay queued
    assert {t[2] for t in after} <= {"moved-w4", "w5", "w6", "w7"}
    if mode == "sync":  # batch 4 may have started with w4 before the swap was asked for
        assert trained[4][1:] in (("old", "w4"), ("new", "moved-w4"))
        assert [t[1:] for t in trained[5:]] == [("new", "w5"), ("new", "w6"), ("new", "w7")]
