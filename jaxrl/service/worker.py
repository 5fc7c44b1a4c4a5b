"""The service's one worker thread: jobs in submission order, compatible ones run together.

`submit(fn, *args)` queues a job that runs alone. `submit_many(fn, item, key, lane)` queues a
batchable one: when it reaches the head of the queue, the worker takes it and every later queued
job with the same `key` (up to `max_batch`) and runs them in one call, `fn([item, ...])`, which
returns one result per item (an `Exception` instance fails that item's future alone).

The scheduling rule: nothing waits for company. The worker takes the head job as soon as it is
free; it batches only what is already queued then. A job may run ahead of queued jobs of other
lanes (the server's lane is the training client's model id), never ahead of an earlier job of
its own lane (a client's `forward_backward` never overtakes its own `optim_step`), so each
client sees its requests applied in the order sent. Lane None means no order to keep (such a
job is passed freely, and holds back nothing behind it).
If a batched call raises, each of its items is run again alone, so the error reaches only the
request that caused it.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import functools
import threading
from collections.abc import Callable, Hashable
from typing import Any


@dataclasses.dataclass
class _Job:
    fn: Callable
    args: tuple
    future: concurrent.futures.Future
    key: Hashable | None = None  # None: runs alone
    lane: Hashable | None = None


class Worker:
    """A single-thread executor that batches jobs (`concurrent.futures.Executor`-like)."""

    def __init__(self, max_batch: int = 8, name: str = "jaxrl-svc"):
        if max_batch < 1:
            raise ValueError(f"max_batch must be >= 1, got {max_batch}")
        self.max_batch = max_batch
        self._queue: list[_Job] = []
        self._cv = threading.Condition()
        self._stopped = False
        self.batched_steps = self.batched_jobs = 0  # batchable calls run, jobs they ran
        self._thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self._thread.start()

    def submit(self, fn: Callable, *args, lane: Hashable | None = None
               ) -> concurrent.futures.Future:
        return self._put(_Job(fn, args, concurrent.futures.Future(), None, lane))

    def submit_many(self, fn: Callable[[list], list], item: Any, key: Hashable,
                    lane: Hashable | None = None) -> concurrent.futures.Future:
        return self._put(_Job(fn, (item,), concurrent.futures.Future(), key, lane))

    def _put(self, job: _Job) -> concurrent.futures.Future:
        with self._cv:
            if self._stopped:
                raise RuntimeError("the worker has been shut down")
            self._queue.append(job)
            self._cv.notify()
        return job.future

    def _take(self) -> list[_Job] | None:
        """The next batch (the head job and the compatible jobs behind it), or None to stop."""
        with self._cv:
            while not self._queue and not self._stopped:
                self._cv.wait()
            if not self._queue:
                return None
            head = self._queue[0]
            batch, rest, passed = [head], [], set()
            for job in self._queue[1:]:
                if (head.key is not None and job.key == head.key and job.lane not in passed
                        and len(batch) < self.max_batch):
                    batch.append(job)
                else:
                    rest.append(job)
                    if job.lane is not None:
                        passed.add(job.lane)
            # `passed`: the lanes of the jobs left behind; no later job of theirs jumps them
            self._queue = rest
            return batch

    def _loop(self) -> None:
        while (batch := self._take()) is not None:
            batch = [j for j in batch if j.future.set_running_or_notify_cancel()]
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
                if len(results) != len(batch):
                    raise RuntimeError(f"a batched call returned {len(results)} results for "
                                       f"{len(batch)} items")
            except Exception:  # noqa: BLE001 - isolate the failing item: run each alone
                for job in batch:
                    _run(job.future, lambda job=job: _one(job))
                continue
            for job, result in zip(batch, results, strict=True):
                if isinstance(result, Exception):
                    job.future.set_exception(result)
                else:
                    job.future.set_result(result)

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        with self._cv:
            self._stopped = True
            if cancel_futures:
                for job in self._queue:
                    job.future.cancel()
                self._queue = []
            self._cv.notify_all()
        if wait:
            self._thread.join()


def _one(job: _Job):
    result = job.fn([job.args[0]])[0]
    if isinstance(result, Exception):
        raise result
    return result


def _run(future: concurrent.futures.Future, call: Callable[[], Any]) -> None:
    try:
        future.set_result(call())
    except BaseException as e:  # noqa: BLE001 - delivered to the waiting request
        future.set_exception(e)
