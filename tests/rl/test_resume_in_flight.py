"""Resume is exact in every pipeline mode: a batch the generator made from older weights before a
checkpoint is saved with it and trained on as made after `--resume`, not generated again from
the checkpoint's newer weights (issue 47: in `periodic`, the default, batch 6 was regenerated
from version 6 instead of 5, and the reward at step 6 read 0.219 against 0.125).

The real `Loop`, `Checkpoints` and `DataStates` (the checkpoint's extra state through JSON, as
orbax stores it) with stand-in verbs: no model, milliseconds. The whole-run checks (SIGKILL and
SIGTERM in periodic mode, LoRA) are in tests/rl/test_preemption.py."""

import json
import time
from types import SimpleNamespace

import numpy as np
import pytest
from fake_loop import fake_loop

from jaxrl.rl.buffer import Group, Rollout
from jaxrl.rl.data_state import DataStates
from jaxrl.rl.hooks import Checkpoints
from jaxrl.rl.loop import StopRequested
from jaxrl.rl.rollout import Produced

STEPS = 6


class Counter:
    """A prompt iterator's or tracker's state: how many batches were drawn."""

    def __init__(self):
        self.n = 0

    def get_state(self):
        return {"n": self.n}

    def set_state(self, state):
        self.n = state["n"]


class FakeCheckpointer:
    """`jaxrl.train.checkpoint.Checkpointer`'s surface: extras saved as JSON text per step."""

    def __init__(self, every, saved):
        self.every, self.saved, self.extras = every, saved, {}

    def register(self, name, *, get, set, missing=None):
        self.extras[name] = (get, set)

    def wait(self):
        pass

    def save(self, state, *, step):
        if step not in self.saved:  # as orbax: a step saved once
            self.saved[step] = (state.params, json.dumps({n: g() for n, (g, _) in
                                                          self.extras.items()}))

    def restore(self, step):
        params, text = self.saved[step]
        for name, value in json.loads(text).items():
            self.extras[name][1](value)
        return params


def _run(mode, saved, *, start, every=2, stop_after=None, params="v0"):
    """One run (or its resume from `saved[start]`): returns what each step trained on and the
    batches the generator made: {step: (version it was made from, prompt draw, logprobs)}."""
    prompts, tracker = Counter(), Counter()
    processes = SimpleNamespace(multi=False, count=1, index=0, gather=lambda obj: [obj])
    data_states = DataStates(prompts, tracker, processes)
    ckpt = FakeCheckpointer(every, saved)
    data_states.register(ckpt)
    if start:
        params = ckpt.restore(start)
    data_states.reset()
    checkpoints = Checkpoints(ckpt, data_states)
    made, trained = {}, {}

    def produce(step, weights):
        version = weights()[1]
        prompts.n += 1
        tracker.n += 1
        data_states.record(step)
        time.sleep(0.02)
        logprobs = np.float32([-0.1 * step - 0.01 * version, -1 / 3])  # float32, bit for bit
        rollout = Rollout(prompt=[1, 2], completion=[step, prompts.n], logprobs=list(logprobs),
                          versions=[version, version], reward=0.5 * step)
        made[step] = (version, prompts.n, list(logprobs))
        return Produced(step=step, groups=[Group({"draw": prompts.n}, [rollout])],
                        num_rollouts=1, num_tokens=4, busy_s=0.02, min_version=version,
                        metrics={"reward/mean": 0.5 * step}, samples=[{"draw": prompts.n}])

    def train(step, produced):
        data_states.commit(step)
        r = produced.groups[0].rollouts[0]
        trained[step] = (r.versions[0], produced.groups[0].example["draw"], r.logprobs)
        time.sleep(0.03)
        return {}, f"v{step + 1}"

    loop = fake_loop(mode, produce=produce, train=train, initial_params=params,
                     publish=lambda p, version: (p, {}), checkpoints=checkpoints,
                     max_staleness=1 if mode in ("sync", "periodic") else 2)
    should_stop = None if stop_after is None else (lambda waiting: len(trained) >= stop_after)
    try:
        loop.run(start_step=start, num_steps=STEPS, should_stop=should_stop)
    except StopRequested as stop:  # jaxrl/rl/stopping.py: the stop's checkpoint
        checkpoints.save(stop.steps_done, loop.parts.trainer)
    return trained, made


@pytest.mark.parametrize("mode", ["sync", "periodic", "async", "inflight"])
@pytest.mark.parametrize("stop_after", [None, 3], ids=["kill", "stop"])
def test_the_batches_in_flight_at_a_checkpoint_are_trained_as_made_after_resume(mode,
                                                                                stop_after):
    saved = {}
    before, made_before = _run(mode, saved, start=0, stop_after=stop_after)
    resume_at = 3 if stop_after else 4  # kill: the victim ran on; its checkpoint at 4 is used
    after, made_after = _run(mode, saved, start=resume_at)
    lead = {"sync": 0, "periodic": 1}.get(mode, 2)
    # made before the checkpoint from a version older than the checkpoint's: not made again
    in_flight = [b for b in range(resume_at, STEPS) if made_before.get(b, (STEPS,))[0] < resume_at]
    assert list(made_after) == list(range(resume_at + len(in_flight), STEPS))
    for b in in_flight:  # the same rollouts (versions, prompt draw, float32 logprobs)
        assert after[b] == made_before[b]
        if b in before:
            assert before[b] == made_before[b]
    draws = [after[b][1] for b in range(resume_at, STEPS)]
    assert draws == list(range(resume_at + 1, STEPS + 1))  # each prompt batch once, in order
    if mode == "sync":
        assert not in_flight
    if mode == "periodic":  # batch b from version b - 1, as an uninterrupted periodic run
        assert in_flight == [resume_at]
        assert [after[b][0] for b in range(resume_at, STEPS)] == [b - lead for b in
                                                                  range(resume_at, STEPS)]
    assert max(b - after[b][0] for b in after) <= lead


def test_a_checkpoint_holds_only_batches_begun_from_older_weights():
    """In sync mode nothing is in flight (the checkpoint's extra is empty); in periodic the one
    batch made from the previous version, its arrays as base64 (a few hundred bytes here)."""
    for mode, expect in (("sync", []), ("periodic", [4])):
        saved = {}
        _run(mode, saved, start=0, every=4)
        held = json.loads(saved[4][1])["in_flight"]
        assert [r["step"] for r in held] == expect
        assert json.loads(saved[4][1])["data"] == {"n": 4 + len(expect)}


def test_a_batch_in_flight_comes_back_bit_for_bit_through_json():
    from jaxrl.rl import in_flight

    routing = np.arange(2 * 5 * 2, dtype=np.int32).reshape(2, 5, 2) - 1
    rollout = Rollout(prompt=[7, 8], completion=[9, 10, 11],
                      logprobs=list(np.float32([-0.1, -1 / 3, -7.25])), versions=[4, 4, 5],
                      finish_reason="length", reward=0.75, mask=[1, 0, 1], routing=routing)
    produced = Produced(step=5, groups=[Group({"uid": "a", "n": np.int64(3)}, [rollout], 0.5)],
                        num_rollouts=1, num_tokens=5, busy_s=0.25, min_version=4,
                        metrics={"reward/mean": 0.75, "gen/x": float("nan")},
                        samples=[{"prompt": "p", "completion": "c", "reward": 0.75}])
    text = json.dumps(in_flight.encode(produced, 4))
    back, started = in_flight.decode(json.loads(text))
    assert started == 4
    (group,) = back.groups
    assert group.example == {"uid": "a", "n": 3} and group.weight == 0.5
    (r,) = group.rollouts
    assert (r.prompt, r.completion, r.versions, r.mask) == ([7, 8], [9, 10, 11], [4, 4, 5],
                                                            [1, 0, 1])
    assert np.float32(r.logprobs).tobytes() == np.float32([-0.1, -1 / 3, -7.25]).tobytes()
    assert (r.finish_reason, r.reward) == ("length", 0.75)
    np.testing.assert_array_equal(r.routing, routing)
    assert r.routing.dtype == np.int32
    assert (back.step, back.num_rollouts, back.num_tokens, back.min_version) == (5, 1, 5, 4)
    assert back.metrics["reward/mean"] == 0.75 and np.isnan(back.metrics["gen/x"])
    assert back.samples == produced.samples
