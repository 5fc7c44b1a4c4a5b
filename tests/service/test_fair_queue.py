"""The worker's fair queue: tenants served round-robin, long (stepped) jobs interleaved step by
step with other tenants' requests, and cancelled between steps. No model: milliseconds."""

from __future__ import annotations

import threading

import pytest

from jaxrl.service.worker import Cancelled, Worker


def _stepped(log, name, steps, at=None, wait=None, closed=None):
    """A batch fn whose call is `steps` steps long; step `at` waits for `wait`."""

    def fn(items):
        try:
            for k in range(steps):
                if k == at:
                    assert wait.wait(10)
                log.append(f"{name}{k}")
                yield {}
            yield {0: f"{name} done"}
        finally:
            if closed is not None:
                closed.set()

    return fn


def test_a_second_tenants_request_runs_at_the_long_jobs_next_step():
    log, submitted = [], threading.Event()
    worker = Worker()
    long_job = worker.submit_many(_stepped(log, "a", 6, at=3, wait=submitted), "x", "ka",
                                  tenant="A")
    while len(log) < 3:  # a0 a1 a2 ran; a3 waits until B's job is queued
        threading.Event().wait(0.001)
    short = worker.submit(lambda: log.append("b") or "b done", tenant="B")
    submitted.set()
    assert short.result(10) == "b done" and long_job.result(10) == "a done"
    # B's job took the turn right after A's step in progress: one step of A, not the rest of it
    assert log == ["a0", "a1", "a2", "a3", "b", "a4", "a5"]
    worker.shutdown()


def test_tenants_take_turns_and_each_keeps_its_order():
    gate, log = threading.Event(), []
    worker = Worker(max_batch=1)
    worker.submit(gate.wait)
    futs = [worker.submit(log.append, f"{t}{i}", tenant=t) for t in "AB" for i in range(3)]
    futs.append(worker.submit(log.append, "C0", tenant="C"))
    gate.set()
    [f.result(10) for f in futs]
    assert log == ["A0", "B0", "C0", "A1", "B1", "A2", "B2"]
    worker.shutdown()


def test_cancel_stops_a_stepped_job_between_steps_and_drops_a_queued_one():
    log, hold, closed = [], threading.Event(), threading.Event()
    worker = Worker()
    running = worker.submit_many(_stepped(log, "a", 1000, at=2, wait=hold, closed=closed),
                                 "x", "ka", tenant="A")
    queued = worker.submit(log.append, "never", tenant="A")  # behind A's job in progress
    while len(log) < 2:
        threading.Event().wait(0.001)
    assert worker.cancel(running) and worker.cancel(queued)
    hold.set()
    with pytest.raises(Cancelled):
        running.result(10)
    assert queued.cancelled()
    assert closed.wait(10)  # the generator was closed: its remaining steps never run
    assert log == ["a0", "a1", "a2"] and worker.busy == 0
    assert not worker.cancel(running)  # finished: nothing to cancel
    worker.shutdown()
