"""Prompt iterator: seeded order, exact mid-epoch resume through JSON, disjoint covering shards."""

from __future__ import annotations

import json

import pytest

from jaxrl.data.config import DataConfig
from jaxrl.data.pipeline import PromptIterator, prompt_iterator
from jaxrl.data.solve_rate import SolveRateTracker
from jaxrl.data.tasks import build_task


def _source(n):
    return [{"uid": f"r{i}", "prompt": str(i)} for i in range(n)]


def _uids(it, steps):
    return [[r["uid"] for r in next(it)] for _ in range(steps)]


def test_same_seed_same_order_other_seed_differs():
    a = _uids(PromptIterator(_source(50), prompts_per_step=5, seed=3), 10)
    b = _uids(PromptIterator(_source(50), prompts_per_step=5, seed=3), 10)
    c = _uids(PromptIterator(_source(50), prompts_per_step=5, seed=4), 10)
    assert a == b
    assert a != c
    assert sorted(u for batch in a for u in batch) == sorted(f"r{i}" for i in range(50))


@pytest.mark.parametrize("stop", [3, 7, 13])  # mid-epoch, epoch boundary crossed, later epoch
def test_restore_mid_epoch_continues_uninterrupted_order(stop):
    kw = dict(prompts_per_step=4, seed=11, epochs=3)
    full = _uids(PromptIterator(_source(30), **kw), 22)
    it = PromptIterator(_source(30), **kw)
    head = _uids(it, stop)
    state = json.loads(json.dumps(it.get_state()))  # as stored in the checkpoint's extra dict
    resumed = PromptIterator(_source(30), **kw)
    resumed.set_state(state)
    assert head + _uids(resumed, 22 - stop) == full
    assert resumed.steps == 22


def test_epochs_reshuffle_and_stream_ends():
    it = PromptIterator(_source(10), prompts_per_step=5, seed=0, epochs=2)
    e1, e2 = sum(_uids(it, 2), []), sum(_uids(it, 2), [])
    assert sorted(e1) == sorted(e2) and e1 != e2
    with pytest.raises(StopIteration):
        next(it)
    assert it.epoch == 2.0


def test_partial_last_batch_is_dropped():
    it = PromptIterator(_source(7), prompts_per_step=3, seed=0, epochs=1)
    assert len(_uids(it, 2)) == 2
    with pytest.raises(StopIteration):
        next(it)


def test_process_shards_are_disjoint_and_cover():
    n, count = 23, 3
    seen = []
    for index in range(count):
        it = PromptIterator(_source(n), prompts_per_step=1, seed=5, epochs=1,
                            process_index=index, process_count=count)
        seen.append({r["uid"] for _ in range(it.shard_size) for r in next(it)})
    for i in range(count):
        for j in range(i + 1, count):
            assert not seen[i] & seen[j]
    assert set().union(*seen) == {f"r{i}" for i in range(n)}
    assert sorted(len(s) for s in seen) == [7, 8, 8]


def test_state_from_another_order_is_refused():
    it = PromptIterator(_source(20), prompts_per_step=2, seed=1)
    next(it)
    other = PromptIterator(_source(20), prompts_per_step=2, seed=2)
    with pytest.raises(ValueError, match="different dataset/order"):
        other.set_state(it.get_state())
    shard = PromptIterator(_source(20), prompts_per_step=2, seed=1, process_index=1,
                           process_count=2)
    with pytest.raises(ValueError, match="different dataset/order"):
        shard.set_state(it.get_state())


def test_bad_process_index():
    with pytest.raises(ValueError, match=r"process_index=2 must be in \[0, process_count=2\)"):
        PromptIterator(_source(4), prompts_per_step=1, process_index=2, process_count=2)


def test_tracker_skips_always_solved_prompts():
    tracker = SolveRateTracker(min_samples=2, skip_solved=True)
    tracker.update("r0", [1.0, 1.0])  # always solved: skipped
    tracker.update("r1", [1.0, 0.0])  # mixed: kept
    it = PromptIterator(_source(4), prompts_per_step=3, seed=0, shuffle=False, tracker=tracker)
    assert [r["uid"] for r in next(it)] == ["r1", "r2", "r3"]
    assert it.metrics()["data/skipped_prompts"] == 1.0


def test_skipping_every_prompt_is_an_error_not_a_hang():
    tracker = SolveRateTracker(min_samples=1, skip_solved=True)
    for i in range(4):
        tracker.update(f"r{i}", [1.0])
    it = PromptIterator(_source(4), prompts_per_step=2, seed=0, epochs=0, tracker=tracker)
    with pytest.raises(RuntimeError, match="every one of the 4 prompts"):
        next(it)


def test_task_stream_from_config_is_deterministic():
    cfg = DataConfig(task="pysynth", prompts_per_step=4, seed=7, train_size=100)
    task = build_task(cfg)
    a = [r["prompt"] for r in next(prompt_iterator(task, cfg))]
    b = [r["prompt"] for r in next(prompt_iterator(build_task(cfg), cfg))]
    assert a == b and len(a) == 4


def test_resume_through_the_trainer_checkpoint(tmp_path):
    """The iterator's state rides in the orbax checkpoint's JSON extra; a restored run continues
    with exactly the prompts the uninterrupted run would have seen."""
    import jax
    import jax.numpy as jnp

    from jaxrl.train.checkpoint import Checkpointer
    from jaxrl.train.state import TrainState

    def state(step):
        return TrainState(params={"w": jnp.zeros((2,))}, opt_state=(),
                          step=jnp.asarray(step, jnp.int32), rng=jnp.zeros((2,), jnp.uint32),
                          nonfinite_skips=jnp.zeros((), jnp.int32))

    kw = dict(prompts_per_step=3, seed=2, epochs=2)
    full = _uids(PromptIterator(_source(16), **kw), 10)
    it = PromptIterator(_source(16), **kw)
    ckpt = Checkpointer(tmp_path / "ckpt", every=1, keep=2, use_async=False)
    ckpt.register("data", get=it.get_state, set=it.set_state)
    head = _uids(it, 4)
    ckpt.save(state(4))
    _uids(it, 2)  # progress after the checkpoint is lost with the crash
    ckpt.close()

    resumed = PromptIterator(_source(16), **kw)
    ckpt2 = Checkpointer(tmp_path / "ckpt", every=1, keep=2, use_async=False)
    ckpt2.register("data", get=resumed.get_state, set=resumed.set_state)
    restored = ckpt2.restore(jax.eval_shape(lambda: state(0)))
    ckpt2.close()
    assert int(restored.step) == 4
    assert head + _uids(resumed, 6) == full
