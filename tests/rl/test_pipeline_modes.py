"""Loop modes with stand-in generator/trainer functions (sleeps), no model needed."""

import threading
import time

import pytest
from fake_loop import batch, fake_loop

from jaxrl.rl.hooks import Hook
from jaxrl.rl.loop import PipelineStopped, lead_for


def _fake(gen_s=0.04, train_s=0.04, inflight_chunks=0, fail_produce_at=None, fail_train_at=None):
    log = {"versions": {}, "swaps": {}}

    def produce(step, weights):
        params, version = weights()
        versions = [version]
        for _ in range(inflight_chunks):
            time.sleep(gen_s / max(inflight_chunks, 1))
            versions.append(weights()[1])
        if not inflight_chunks:
            time.sleep(gen_s)
        if fail_produce_at == step:
            raise ValueError("generator broke")
        log["versions"][step] = versions
        assert params == f"gen-{version}"
        return batch(step, min(versions), busy_s=gen_s)

    def train(step, produced):
        time.sleep(train_s)
        if fail_train_at == step:
            raise ValueError("trainer broke")
        return {"loss/total": 1.0 / (step + 1)}, f"params-{step + 1}"

    def publish(params, version):
        return f"gen-{version}", {"pipeline/weight_sync_s": 0.0}

    return produce, train, publish, log


def _run(mode, k=1, steps=6, **kw):
    produce, train, publish, log = _fake(**kw)
    rows = []
    loop = fake_loop(mode, max_staleness=k, produce=produce, train=train, publish=publish,
                     rows=rows)
    t0 = time.perf_counter()
    loop.run(start_step=0, num_steps=steps)
    return time.perf_counter() - t0, rows, log


@pytest.mark.parametrize("mode,k", [("sync", 1), ("periodic", 1), ("async", 2), ("inflight", 2)])
def test_staleness_never_exceeds_bound(mode, k):
    _, rows, log = _run(mode, k, inflight_chunks=4 if mode == "inflight" else 0)
    bound = lead_for(mode, k)
    assert len(rows) == 6
    for step, versions in log["versions"].items():
        assert all(0 <= step - v <= bound for v in versions), (step, versions)
    if mode == "sync":
        assert all(v == [s] for s, v in log["versions"].items())


def test_inflight_swaps_weights_mid_batch():
    _, _, log = _run("inflight", 2, gen_s=0.08, train_s=0.02, inflight_chunks=4)
    assert any(len(set(v)) > 1 for v in log["versions"].values())


def test_periodic_overlaps_and_beats_sync():
    sync_s, sync_rows, _ = _run("sync")
    per_s, per_rows, _ = _run("periodic")
    assert sync_s / per_s > 1.3
    idle_sync = sum(r["pipeline/trainer_idle_frac"] for r in sync_rows[1:]) / 5
    idle_per = sum(r["pipeline/trainer_idle_frac"] for r in per_rows[1:]) / 5
    assert idle_sync > 0.3 and idle_per < idle_sync
    for r in per_rows:
        assert set(r) >= {"pipeline/rollouts_per_s_produced", "pipeline/rollouts_per_s_consumed",
                          "pipeline/generator_idle_frac", "pipeline/weight_sync_s"}


@pytest.mark.parametrize("where", ["produce", "train"])
def test_errors_stop_both_sides(where):
    kw = {"fail_produce_at": 2} if where == "produce" else {"fail_train_at": 2}
    before = threading.active_count()
    side = "generator" if where == "produce" else "trainer"
    with pytest.raises(ValueError, match=f"{side} broke"):
        _run("periodic", **kw)
    assert threading.active_count() == before  # the generator thread was joined


def test_keyboard_interrupt_stops_cleanly():
    produce, train, publish, _ = _fake()

    def interrupted(step, produced):
        if step == 1:
            raise KeyboardInterrupt
        return train(step, produced)

    loop = fake_loop("async", max_staleness=2, produce=produce, train=interrupted,
                     publish=publish)
    before = threading.active_count()
    with pytest.raises(KeyboardInterrupt):
        loop.run(start_step=0, num_steps=5)
    assert threading.active_count() == before


def test_resume_from_a_later_step_and_bad_mode():
    produce, train, publish, log = _fake()
    rows = []
    loop = fake_loop("sync", produce=produce, train=train, publish=publish,
                     initial_params="params-3", rows=rows)
    loop.run(start_step=3, num_steps=5)
    assert len(rows) == 2 and log["versions"] == {3: [3], 4: [4]}
    with pytest.raises(ValueError, match="valid choices"):
        lead_for("eager", 1)
    with pytest.raises(ValueError, match="max_staleness >= 1"):
        fake_loop("async", max_staleness=0, produce=produce, train=train, publish=publish)
    assert PipelineStopped


@pytest.mark.parametrize("mode", ["sync", "periodic"])
def test_lead_zero_releases_generator_weights_for_each_update(mode):
    """In `sync` the generator waits for each update, so its weights are released before the
    update (the trainer sees none published) and the next publish brings them back; calls on
    the generator between steps (evaluation) still see the newest weights. `periodic`
    generates during the update: nothing is released."""
    produce, _, publish, log = _fake(gen_s=0.01, train_s=0.01)
    events = []

    def train(step, produced):
        events.append(("train", step, loop._published.get()))
        return {}, f"params-{step + 1}"

    def call(record):
        weights = loop.call_on_generator(lambda generator, weights: weights())
        events.append(("call", record.step, weights))

    loop = fake_loop(mode, produce=produce, train=train, publish=publish,
                     release=lambda: events.append(("release",)), hooks=[Hook(call)])
    loop.run(start_step=0, num_steps=3)
    assert sorted(log["versions"]) == [0, 1, 2]  # produce asserted gen-<version> each time
    calls = [e for e in events if e[0] == "call"]
    assert calls == [("call", s, (f"gen-{s + 1}", s + 1)) for s in range(3)]
    trains = [e for e in events if e[0] == "train"]
    if mode == "sync":
        assert [e for e in events if e[0] != "call"] == [
            x for s in range(3) for x in (("release",), ("train", s, (None, s)))]
    else:
        assert ("release",) not in events
        assert all(e[2][0] is not None for e in trains)
