"""The service's one worker thread: a fair queue per tenant, compatible jobs run together, long
jobs in steps.

`submit(fn, *args)` queues a job that runs alone. `submit_many(fn, item, key, lane)` queues a
batchable one: when it is taken, every other queued job with the same `key` (up to `max_batch`)
joins it and they run in one call, `fn([item, ...])`, which returns one result per item (an
`Exception` instance fails that item's future alone), or a generator: a *stepped* batch. The
worker runs a stepped batch one `next()` at a time; each step yields `{index: result}` for the
items it finished (their futures are set at once) and then hands the worker to the next tenant.

Fairness: each job has a `tenant` (the server's: the request's API key). The worker serves
tenants round-robin, least recently served first, one thing per turn: a tenant's stepped batch
in progress takes one step, else its oldest eligible queued job starts. A tenant has at most one
stepped batch in progress, and its other jobs wait behind it, so one tenant's long sampling job
delays another's request by one step per turn, never by the whole job.

Order: a job never starts ahead of an earlier job of its own lane, nor while a batch holding a
job of its lane is in progress (the server's lane is the training client's model id: a client's
`forward_backward` never overtakes its own `optim_step`). Lane None means no order to keep.
Nothing waits for company: a batch holds only what is queued when it is taken. If a batched
call raises, each of its items is run again alone, so the error reaches only its own request;
if a stepped batch raises, its unfinished items get the error.

`cancel(future)`: a queued job is dropped; an item of a stepped batch in progress fails with
`Cancelled` before the batch's next step, and a batch whose items are all finished or cancelled
is closed there.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import inspect
import itertools
import logging
import threading
from collections.abc import Callable, Generator, Hashable
from typing import Any

log = logging.getLogger("jaxrl.service")


class Cancelled(Exception):
    """The request was cancelled (`Worker.cancel`) before it finished."""


@dataclasses.dataclass(eq=False)
class _Job:
    fn: Callable
    args: tuple
    future: concurrent.futures.Future
    key: Hashable | None = None  # None: runs alone
    lane: Hashable | None = None
    tenant: Hashable | None = None


@dataclasses.dataclass(eq=False)
class _Stepped:
    """A stepped batch in progress: its jobs (by index) and its generator."""

    jobs: dict[int, _Job]
    steps: Generator
    tenant: Hashable | None
    lanes: frozenset


class Worker:
    """A single-thread executor that batches jobs and serves tenants fairly."""

    def __init__(self, max_batch: int = 8, name: str = "jaxrl-svc"):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self._queue: list[_Job] = []
        self._stepped: dict[Hashable, _Stepped] = {}  # tenant -> its batch in progress
        self._served: dict[Hashable, int] = {}  # tenant -> turn it was last served
        self._turns = itertools.count()
        self._cv = threading.Condition()
        self._stopped = False
        self.batched_steps = self.batched_jobs = 0  # batchable calls run, jobs they ran
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args, lane: Hashable | None = None,
               tenant: Hashable | None = None) -> concurrent.futures.Future:
        return self._put(_Job(fn, args, concurrent.futures.Future(), None, lane, tenant))

    def submit_many(self, fn: Callable[[list], Any], item: Any, key: Hashable,
                    lane: Hashable | None = None, tenant: Hashable | None = None
                    ) -> concurrent.futures.Future:
        return self._put(_Job(fn, (item,), concurrent.futures.Future(), key, lane, tenant))

    def _put(self, job: _Job) -> concurrent.futures.Future:
        with self._cv:
            if self._stopped:
                raise RuntimeError("the worker has been shut down")
            self._queue.append(job)
            self._cv.notify()
        return job.future

    def cancel(self, future: concurrent.futures.Future) -> bool:
        """Cancel a queued or stepped job's future; False when it already finished or runs in
        a call that cannot be interrupted (an unstepped one)."""
        with self._cv:
            for job in self._queue:
                if job.future is future:
                    self._queue.remove(job)
                    return future.cancel()
            for stepped in self._stepped.values():
                if any(j.future is future for j in stepped.jobs.values()) and not future.done():
                    future.set_exception(Cancelled("cancelled by the client"))
                    return True
        return False

    @property
    def busy(self) -> int:
        """Jobs queued or in progress (tests, benchmarks)."""
        with self._cv:
            return len(self._queue) + sum(len(s.jobs) for s in self._stepped.values())

    # ------------------------------------------------------------------------- scheduling

    def _take(self) -> _Stepped | list[_Job] | None:
        """The next turn: a stepped batch to advance, or a new batch (the head job of the
        tenant whose turn it is, and the compatible jobs queued with it); None to stop."""
        with self._cv:
            while not self._queue and not self._stepped and not self._stopped:
                self._cv.wait()
            if self._stopped:
                return None
            busy_lanes = set().union(*(s.lanes for s in self._stepped.values()))
            heads: dict[Hashable, int] = {}  # tenant -> index of its first eligible job
            seen_lanes: set = set()
            for i, job in enumerate(self._queue):
                free = job.lane is None or (job.lane not in seen_lanes
                                            and job.lane not in busy_lanes)
                if free and job.tenant not in self._stepped:
                    heads.setdefault(job.tenant, i)
                if job.lane is not None:
                    seen_lanes.add(job.lane)
            order = [(self._served.get(t, -1), -1, t) for t in self._stepped]
            order += [(self._served.get(t, -1), i, t) for t, i in heads.items()]
            if not order:  # every queued job waits on a lane: cannot happen, but never spin
                self._cv.wait(0.1)
                return []
            _, i, tenant = min(order, key=lambda o: o[:2])
            self._served[tenant] = next(self._turns)
            if i < 0:
                return self._stepped[tenant]
            return self._batch(self._queue[i], busy_lanes)

    def _batch(self, head: _Job, busy_lanes: set) -> list[_Job]:
        """`head` and the queued jobs that may run with it; all leave the queue."""
        batch, rest, passed = [head], [], set(busy_lanes)
        for job in self._queue:
            if job is head:
                continue
            if (head.key is not None and job.key == head.key and job.lane not in passed
                    and job.tenant not in self._stepped and len(batch) < self.max_batch):
                batch.append(job)
            else:
                rest.append(job)
                if job.lane is not None:
                    passed.add(job.lane)  # no later job of a lane left behind jumps it
        self._queue = rest
        return batch

    # ---------------------------------------------------------------------------- running

    def _loop(self) -> None:
        while (turn := self._take()) is not None:
            if isinstance(turn, _Stepped):
                self._advance(turn)
                continue
            batch = [j for j in turn if j.future.set_running_or_notify_cancel()]
            if not batch:
                continue
            if batch[0].key is None:
                job = batch[0]
                _run(job.future, functools.partial(job.fn, *job.args))
                continue
            self.batched_steps, self.batched_jobs = (self.batched_steps + 1,
                                                     self.batched_jobs + len(batch))
            try:
                results = batch[0].fn([j.args[0] for j in batch])
                if inspect.isgenerator(results):
                    self._start(batch, results)
                    continue
                if len(results) != len(batch):
                    raise RuntimeError(f"a batched call returned {len(results)} results for "
                                       f"{len(batch)} items")
            except Exception:  # noqa: BLE001 - isolate the failing item: run each alone
                for job in batch:
                    _run(job.future, lambda job=job: _one(job))
                continue
            for job, result in zip(batch, results, strict=True):
                _deliver(job.future, result)

    def _start(self, batch: list[_Job], steps: Generator) -> None:
        stepped = _Stepped(dict(enumerate(batch)), steps, batch[0].tenant,
                           frozenset(j.lane for j in batch if j.lane is not None))
        with self._cv:
            self._stepped[stepped.tenant] = stepped
        self._advance(stepped)

    def _advance(self, stepped: _Stepped) -> None:
        """One step of a stepped batch; it ends when no unfinished item is left."""
        try:
            if any(not j.future.done() for j in stepped.jobs.values()):
                for i, result in next(stepped.steps).items():
                    _deliver(stepped.jobs[i].future, result)
        except StopIteration:
            pass
        except Exception as e:  # noqa: BLE001 - delivered to the batch's unfinished requests
            log.error("a stepped batch failed", exc_info=True)
            for job in stepped.jobs.values():
                _deliver(job.future, e)
        if any(not j.future.done() for j in stepped.jobs.values()) and not self._ended(stepped):
            return
        stepped.steps.close()
        for job in stepped.jobs.values():
            _deliver(job.future, RuntimeError("internal: a stepped batch ended without this "
                                              "item's result"))
        with self._cv:
            self._stepped.pop(stepped.tenant, None)

    @staticmethod
    def _ended(stepped: _Stepped) -> bool:
        return inspect.getgeneratorstate(stepped.steps) == inspect.GEN_CLOSED

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._cv:
            self._stopped = True
            if cancel_futures:
                for job in self._queue:
                    job.future.cancel()
                self._queue = []
                for stepped in self._stepped.values():
                    for job in stepped.jobs.values():
                        _deliver(job.future, Cancelled("the server is shutting down"))
            self._cv.notify_all()
        if wait:
            self._thread.join()


def _deliver(future: concurrent.futures.Future, result) -> None:
    """Set a running future's result (an `Exception` instance: its error), unless it is done
    (cancelled meanwhile)."""
    try:
        if isinstance(result, Exception):
            future.set_exception(result)
        else:
            future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass


def _one(job: _Job):
    result = job.fn([job.args[0]])
    if inspect.isgenerator(result):  # a stepped call, run alone to its end
        done = {}
        for step in result:
            done.update(step)
        result = [done.get(0, RuntimeError("internal: a stepped call gave no result"))]
    result = result[0]
    if isinstance(result, Exception):
        raise result
    return result


def _run(future: concurrent.futures.Future, call: Callable[[], Any]) -> None:
    try:
        result = call()
    except BaseException as e:  # noqa: BLE001 - delivered to the waiting request
        try:
            future.set_exception(e)
        except concurrent.futures.InvalidStateError:
            pass
        return
    try:
        future.set_result(result)
    except concurrent.futures.InvalidStateError:
        pass
