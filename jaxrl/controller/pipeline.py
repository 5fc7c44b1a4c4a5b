"""Pipeline modes: how generation overlaps training, from one Python process.

Batch `b` is trained at step `b` by a trainer holding policy version `b` (the params after `b`
updates). The generator may start batch `b` once version `b - ahead` is published:

| mode       | ahead | what happens                                                        |
|------------|-------|---------------------------------------------------------------------|
| `sync`     | 0     | generate batch t with v_t → train → reshard → repeat                |
| `periodic` | 1     | the generator makes batch t+1 with v_t while the trainer trains on t |
| `async`    | k     | the generator runs up to k versions ahead                           |
| `inflight` | k     | as `async`, and new weights are swapped in between decode chunks    |

So staleness (trainer version minus the version of a token) is ≤ `ahead` by construction; the
rollout buffer re-checks it. The generator runs in a worker thread around jitted calls (JAX
releases the GIL while running), the trainer in the calling thread. Errors in either side, or
Ctrl-C, stop both: the worker is joined, nothing is left running.

The pipeline knows nothing about models: it calls

* `produce(step, weights) -> Produced` in the generator thread — makes batch `step`, calling
  `weights() -> (generator_params, version)` for the newest published weights: once at the start
  of the batch, and in `inflight` mode again between decode chunks;
* `train(step, produced) -> (metrics, params)` in the calling thread — one update on that batch;
* `publish(params, version) -> (generator_params, metrics)` — reshards the trainer's `params`
  onto the generator mesh (weight sync); the result becomes what `weights()` returns;
* `release()` (optional), in the calling thread before an update the generator must wait for
  (lead 0: `sync`): frees the generator's weights and decode state for the update's duration
  (on CPU they share the trainer's memory); the next publish brings weights back.

`call_on_generator(fn)` runs other work that needs the generator (mid-run evaluation) on the
generator thread between batches, so one engine serves both; `swap_generator(fn)` is the safe
point where a live move replaces the generator (both threads paused, then the new weights
published before the next batch).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

from jaxrl.config.sections import PIPELINE_MODES, PipelineMode, ahead_for
from jaxrl.trace import TraceWriter

log = logging.getLogger("jaxrl")

Mode = PipelineMode
MODES = PIPELINE_MODES


class StopRequested(Exception):
    """A stop asked for at a safe point (`Pipeline.run(should_stop=...)`), after `steps_done`."""

    def __init__(self, steps_done: int):
        super().__init__(f"stop requested after {steps_done} steps")
        self.steps_done = steps_done


@dataclasses.dataclass
class Produced:
    """One batch from the generator side."""

    step: int
    payload: Any  # e.g. scored groups
    num_rollouts: int
    num_tokens: int
    busy_s: float  # generator time spent producing it (excludes waiting for weights)
    min_version: int
    metrics: dict = dataclasses.field(default_factory=dict)  # the generator side's statistics
    # a few (prompt, completion, reward) dicts of the batch, for samples.jsonl / TensorBoard text
    samples: list = dataclasses.field(default_factory=list)


class PipelineStopped(RuntimeError):
    """The pipeline was stopped (Ctrl-C, an error on the other side, or `stop()`)."""


class _Published:
    """The latest weights for the generator, with a condition to wait for a version."""

    def __init__(self, params: Any, version: int):
        self.params, self.version = params, version
        self.cond = threading.Condition()

    def set(self, params: Any, version: int) -> None:
        with self.cond:
            self.params, self.version = params, version
            self.cond.notify_all()

    def get(self) -> tuple[Any, int]:
        with self.cond:
            return self.params, self.version


class Pipeline:
    def __init__(
        self,
        *,
        mode: Mode,
        max_staleness: int = 1,
        produce: Callable[[int, Callable[[], tuple[Any, int]]], Produced],
        train: Callable[[int, Produced], tuple[dict, Any]],
        publish: Callable[[Any, int], tuple[Any, dict]],
        trace: TraceWriter | None = None,
        poll_s: float = 0.05,
        lead: Callable[[], int] | None = None,
        release: Callable[[], None] | None = None,
    ):
        self.mode = mode
        # lead(): the lead for batches not yet started, asked after each step (adaptive
        # staleness, jaxrl.controller.lead); it may lie in 0..ahead_for(mode, max_staleness)
        self._lead = lead
        self.ahead = self._max_ahead = ahead_for(mode, max_staleness)
        if mode in ("async", "inflight") and max_staleness < 1:
            raise ValueError(f"mode {mode!r} needs max_staleness >= 1, got {max_staleness}")
        self._produce, self._train, self._publish = produce, train, publish
        self._release = release
        self.trace = trace or TraceWriter()
        self.poll_s = poll_s
        self._stop = threading.Event()
        self._ready: dict[int, Produced] = {}
        self._ready_cond = threading.Condition()
        self._error: BaseException | None = None
        self._gen_idle_s = 0.0
        self._gen_busy_s = 0.0
        self._published: _Published | None = None
        self._thread: threading.Thread | None = None
        self._calls: collections.deque = collections.deque()  # work for the generator thread
        self._should_stop: Callable[[bool], bool] = lambda waiting: False

    # ------------------------------------------------------------------ generator side

    def _wait_for_version(self, batch: int) -> None:
        """Wait until batch `batch` may start: version `batch - ahead` published (the lead is
        read again while waiting, so a lead raised meanwhile takes effect at once)."""
        pub = self._published
        with pub.cond:
            while pub.version < batch - self.ahead:
                if self._stop.is_set():
                    raise PipelineStopped()
                if self._calls:
                    pub.cond.release()
                    try:
                        self._serve_calls()
                    finally:
                        pub.cond.acquire()
                    continue
                pub.cond.wait(self.poll_s)

    def _serve_calls(self) -> None:
        while self._calls:
            fn, future = self._calls.popleft()
            with self.trace.span("generator", getattr(fn, "__name__", "call")):
                try:
                    future.set_result(fn(self._published.get))
                except BaseException as e:  # handed to the caller
                    future.set_exception(e)

    def call_on_generator(self, fn: Callable[[Callable[[], tuple[Any, int]]], Any]) -> Any:
        """Run `fn(weights)` on the generator thread, between batches (or while it waits for
        weights), and return its result: work that needs the generator's engine mid-run (e.g.
        held-out evaluation with the newest published weights). Runs inline when the pipeline
        is not running."""
        if self._thread is None:
            return fn(self._published.get if self._published else lambda: (None, -1))
        future: concurrent.futures.Future = concurrent.futures.Future()
        self._calls.append((fn, future))
        while True:
            try:
                return future.result(timeout=self.poll_s)
            except concurrent.futures.TimeoutError:
                if self._error is not None:
                    raise self._error from None
                if self._stop.is_set() or not self._thread.is_alive():
                    raise PipelineStopped() from None

    def swap_generator(self, fn: Callable[[Callable[[], tuple[Any, int]]], tuple[Any, int]]
                       ) -> None:
        """Run `fn(weights) -> (generator_params, version)` on the generator thread between
        batches, while the trainer thread waits here, and publish its result there, before the
        generator starts another batch: a generator rebuilt on other devices (a live move,
        jaxrl/controller/rebalance.py) takes over from the next batch, none lost or made twice
        (batches already made are host data and stay queued)."""
        def swap(weights):
            params, version = fn(weights)
            self._published.set(params, version)

        if self._published is None:
            self._published = _Published(None, -1)
        self.call_on_generator(swap)

    def _generator_loop(self, start: int, end: int) -> None:
        try:
            for b in range(start, end):
                self._serve_calls()
                t0 = time.perf_counter()
                self._wait_for_version(b)
                waited = time.perf_counter() - t0
                self._gen_idle_s += waited
                if waited > 1e-3:
                    self.trace.add("generator", "wait_weights", self.trace.now() - waited, waited)
                t1 = time.perf_counter()
                with self.trace.span("generator", "produce", step=b):
                    produced = self._produce(b, self._published.get)
                self._gen_busy_s += time.perf_counter() - t1
                with self._ready_cond:
                    self._ready[b] = produced
                    self._ready_cond.notify_all()
                if self._stop.is_set():
                    return
            while not self._stop.is_set():  # every batch made: serve calls until the end
                self._serve_calls()
                self._stop.wait(self.poll_s)
        except PipelineStopped:
            return
        except BaseException as e:  # surfaced to the trainer thread
            self._error = e
            self._stop.set()
            with self._ready_cond:
                self._ready_cond.notify_all()

    # ------------------------------------------------------------------ trainer side

    def _wait_for_batch(self, step: int) -> Produced:
        with self._ready_cond:
            while step not in self._ready:
                if self._error is not None:
                    raise self._error
                if self._stop.is_set():
                    raise PipelineStopped()
                if self._should_stop(True):
                    raise StopRequested(step)
                self._ready_cond.wait(self.poll_s)
            return self._ready.pop(step)

    def run(
        self,
        *,
        start_step: int,
        num_steps: int,
        initial_params: Any,
        on_step: Callable[[int, dict], None] | None = None,
        should_stop: Callable[[bool], bool] | None = None,
    ) -> None:
        """Run steps `start_step .. num_steps-1`; `on_step(step, metrics)` after each update.

        `initial_params` are published as version `start_step` before the generator starts.
        `should_stop(waiting)` is asked at the safe points, after each step (`waiting=False`)
        and while the trainer waits for a batch (True); when it says so, the run raises
        `StopRequested` with the steps finished (a batch not trained on is abandoned).
        """
        self._should_stop = should_stop or (lambda waiting: False)
        self._published = _Published(None, start_step - 1)
        self._timed_publish(initial_params, start_step)
        self._thread = threading.Thread(
            target=self._generator_loop, args=(start_step, num_steps), name="jaxrl-generator",
            daemon=True,
        )
        self._thread.start()
        try:
            for step in range(start_step, num_steps):
                window_start = time.perf_counter()
                idle0, busy0 = self._gen_idle_s, self._gen_busy_s
                with self.trace.span("trainer", "wait_batch", step=step):
                    produced = self._wait_for_batch(step)
                waited = time.perf_counter() - window_start
                t0 = time.perf_counter()
                if self._release is not None and self.ahead == 0:
                    self._release_generator()
                with self.trace.span("trainer", "train_step", step=step):
                    metrics, params = self._train(step, produced)
                if self._lead is not None:
                    self.ahead = min(max(int(self._lead()), 0), self._max_ahead)
                pub_metrics = self._timed_publish(params, step + 1)
                train_s = time.perf_counter() - t0
                window = time.perf_counter() - window_start
                gen_busy = self._gen_busy_s - busy0
                metrics = dict(metrics)
                metrics.update(pub_metrics)
                metrics.update({
                    "pipeline/step_s": window,
                    "pipeline/trainer_idle_frac": waited / window,
                    "pipeline/generator_idle_frac": min(1.0, (self._gen_idle_s - idle0) / window),
                    "pipeline/rollouts_per_s_consumed": produced.num_rollouts / train_s,
                    "pipeline/rollouts_per_s_produced": produced.num_rollouts
                    / max(produced.busy_s, 1e-9),
                    "pipeline/generator_busy_s": gen_busy,
                    "pipeline/trainer_busy_s": train_s,
                    "pipeline/ahead": float(self.ahead),
                })
                if on_step is not None:
                    on_step(step, metrics)
                if self._should_stop(False):
                    raise StopRequested(step + 1)
        except BaseException:  # an error or Ctrl-C: a stuck generator is reported, not waited on
            self.stop(timeout_s=10.0, abandon=True)
            raise
        self.stop()

    def _release_generator(self) -> None:
        """Lead 0: the generator waits for this update's weights, so the published ones (and
        whatever `release` frees: the engine's copy, its KV cache) are not needed until the next
        publish; freeing them makes room for the update. The generator thread is idle here: it
        made this step's batch and may start no other before the next publish, and the calls
        it serves (`call_on_generator`) come from this thread, between steps."""
        with self.trace.span("generator", "release"):
            self._published.set(None, self._published.version)
            self._release()

    def _timed_publish(self, params: Any, version: int) -> dict:
        start = self.trace.now()
        gen_params, metrics = self._publish(params, version)
        self.trace.add("weight_sync", "reshard", start, self.trace.now() - start, version=version)
        self._published.set(gen_params, version)
        return metrics or {}

    def stop(self, timeout_s: float = 60.0, *, abandon: bool = False) -> None:
        """Stop the generator thread and wait for it (bounded); one still running then is an
        error, or with `abandon` (already stopping for another reason) a warning."""
        self._stop.set()
        if self._published is not None:
            with self._published.cond:
                self._published.cond.notify_all()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive() and abandon:
                log.warning("generator thread still running %.0fs after the stop (a reward or "
                            "generation that does not return): abandoned", timeout_s)
            elif self._thread.is_alive():
                raise RuntimeError(
                    f"generator thread did not stop within {timeout_s:.0f}s after shutdown"
                )
            self._thread = None
