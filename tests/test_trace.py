"""TraceWriter: valid Chrome trace JSON, named tracks, thread safety, atomic save."""

import json
import threading

import pytest

from jaxrl.trace import ROLES, TraceWriter, merge


class FakeClock:
    def __init__(self):
        self.t = 100.0

    def __call__(self):
        return self.t


def test_span_add_counter_and_tracks(tmp_path):
    clock = FakeClock()
    trace = TraceWriter(clock=clock, process_name="measured")
    with trace.span("trainer", "train_step", step=3):
        clock.t += 0.25
    trace.add("weight_sync", "reshard", 0.25, 0.1, gbytes=1.5)
    trace.counter("generator", "active_slots", 0.3, slots=7)
    path = trace.save(tmp_path / "sub" / "trace.json")
    data = json.loads(open(path).read())
    events = data["traceEvents"]
    names = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert list(names) == list(ROLES)
    (step,) = [e for e in events if e["name"] == "train_step"]
    assert step["ph"] == "X" and step["tid"] == names["trainer"]
    assert step["ts"] == 0 and step["dur"] == pytest.approx(250_000)
    assert step["args"] == {"step": 3}
    (sync,) = [e for e in events if e["name"] == "reshard"]
    assert sync["ts"] == pytest.approx(250_000) and sync["dur"] == pytest.approx(100_000)
    (count,) = [e for e in events if e["ph"] == "C"]
    assert count["args"] == {"slots": 7}
    assert not list((tmp_path / "sub").glob(".trace-*")), "temporary file left behind"


def test_span_records_even_when_body_raises():
    trace = TraceWriter()
    with pytest.raises(RuntimeError), trace.span("sandbox", "exec"):
        raise RuntimeError("boom")
    assert [e["name"] for e in trace.events() if e["ph"] == "X"] == ["exec"]


def test_unknown_track_names_valid_ones():
    trace = TraceWriter()
    with pytest.raises(ValueError, match="valid tracks.*trainer"):
        trace.add("learner", "x", 0.0, 1.0)
    with pytest.raises(ValueError, match="dur_s"):
        trace.add("trainer", "x", 0.0, -1.0)


def test_thread_safety():
    trace = TraceWriter()

    def work(role):
        for i in range(500):
            trace.add(role, "e", i * 1e-3, 1e-4, i=i)

    threads = [threading.Thread(target=work, args=(r,)) for r in ROLES for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    spans = [e for e in trace.events() if e["ph"] == "X"]
    assert len(spans) == 500 * 2 * len(ROLES)
    json.dumps(trace.to_dict())


def test_merge_gives_one_process_per_label(tmp_path):
    a, b = TraceWriter(), TraceWriter()
    a.add("trainer", "train_step", 0.0, 1.0)
    b.add("trainer", "train_step", 0.0, 1.2)
    out = merge({"measured": a.save(tmp_path / "a.json"), "simulated": b.save(tmp_path / "b.json")},
                tmp_path / "both.json")
    events = json.load(open(out))["traceEvents"]
    labels = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert labels == {1: "measured", 2: "simulated"}
