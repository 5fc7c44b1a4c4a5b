"""The RL loop: one step is rollout → update → weight sync, overlapped by the pipeline mode.

    loop = Loop(Parts(trainer, generator), mode=..., rollouts=producer, update=Update(...),
                hooks=[...], ...)
    parts = loop.run(start_step=0, num_steps=cfg.pipeline.steps)   # the parts in use at the end

Batch `b` is trained at step `b` by a trainer holding policy version `b` (the params after `b`
updates). The generator may start batch `b` once version `b - lead` is published:

| mode       | lead  | what happens                                                        |
|------------|-------|---------------------------------------------------------------------|
| `sync`     | 0     | generate batch t with v_t → train → reshard → repeat                |
| `periodic` | 1     | the generator makes batch t+1 with v_t while the trainer trains on t |
| `async`    | k     | the generator runs up to k versions ahead                           |
| `inflight` | k     | as `async`, and new weights are swapped in between decode chunks    |

So staleness (trainer version minus the version of a token) is ≤ the lead by construction; the
update re-checks it (`pipeline.max_staleness`). With `pipeline.lead=auto` the lead moves within
0..k after each step (jaxrl/rl/lead.py). The generator runs in a worker thread around jitted
calls (JAX releases the GIL while running), the trainer in the calling thread. Errors in
either side, or Ctrl-C, stop both: the worker is joined, nothing is left running.

One step, in the trainer thread (`_train_step`), reads as the algorithm:

  1. rollout  the batch the generator thread made (`rollouts.produce`, jaxrl/rl/rollout.py);
  2. update   `update(step, batch, trainer)` → metrics (jaxrl/rl/update.py);
  3. sync     `generator.publisher.publish(params, step + 1)` → the weights the generator
              installs next (jaxrl/rl/sync.py);
  4. the row: the step's metrics, timing, reward/sandbox columns, reduced over processes;
  5. hooks    add columns to the completed row, in any order (jaxrl/rl/hooks.py);
  6. a live move (jaxrl/rl/rebalance.py) builds new `Parts`, swapped here, between batches;
  7. the row is logged, then the checkpoint written if due.

`call_on_generator(fn)` runs other work that needs the generator (mid-run evaluation) on the
generator thread between batches, so one engine serves both.

A checkpoint after `n` steps saves the batches the generator began from weights older than
version `n` (the one the checkpoint holds), waiting for any still being made; a resume trains on
them as made rather than generating them again (jaxrl/rl/in_flight.py). A stop at a safe point
finishes them first, so the checkpoint it writes covers them.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import logging
import threading
import time
from collections.abc import Callable
from types import MappingProxyType
from typing import Any

from jaxrl.config.sections import PIPELINE_MODES, PipelineMode, lead_for
from jaxrl.rl.hooks import Checkpoints, Hook, StepRecord, run_hooks
from jaxrl.rl.rollout import Produced
from jaxrl.trace import TraceWriter

log = logging.getLogger("jaxrl")

Mode = PipelineMode
MODES = PIPELINE_MODES


class StopRequested(Exception):
    """A stop asked for at a safe point (`Loop.run(should_stop=...)`), after `steps_done`."""

    def __init__(self, steps_done: int):
        super().__init__(f"stop requested after {steps_done} steps")
        self.steps_done = steps_done


class PipelineStopped(RuntimeError):
    """The loop was stopped (Ctrl-C, an error on the other side, or `stop()`)."""


@dataclasses.dataclass(frozen=True)
class Parts:
    """The components a step uses, swapped as a whole by the loop at a step boundary (a live
    move): the trainer, and the generator side (`jaxrl.rl.sync.Generator`: publisher, engine,
    scheduler)."""

    trainer: Any
    generator: Any
    trainer_chips: int = 1
    generator_chips: int = 1


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


class Loop:
    def __init__(self, parts: Parts, *, mode: Mode, max_staleness: int = 1, rollouts, update,
                 hooks: list[Hook] = (), log_row: Callable[[int, dict, list], None] | None = None,
                 checkpoints: Checkpoints | None = None, rebalance=None,
                 row_metrics: Callable[[], dict] | None = None,
                 reduce: Callable[[dict], dict] | None = None,
                 lead: Callable[[], int] | None = None, trace: TraceWriter | None = None,
                 poll_s: float = 0.05):
        if mode in ("async", "inflight") and max_staleness < 1:
            raise ValueError(f"mode {mode!r} needs max_staleness >= 1, got {max_staleness}")
        self.mode = mode
        self.lead = self._max_lead = lead_for(mode, max_staleness)
        self._lead_rule = lead  # pipeline.lead=auto: the lead for batches not yet started
        self.rollouts, self.update, self.hooks = rollouts, update, list(hooks)
        self.log_row = log_row or (lambda step, row, samples: None)
        self.checkpoints, self.rebalance = checkpoints, rebalance
        self.row_metrics = row_metrics or dict
        self.reduce = reduce or (lambda m: m)
        self.trace = trace or TraceWriter()
        self.poll_s = poll_s
        self.parts = parts
        self._stop = threading.Event()
        self._ready: dict[int, Produced] = {}
        self._started: dict[int, int] = {}  # batch -> newest version published when it began
        self._ready_cond = threading.Condition()
        self._error: BaseException | None = None
        self._gen_idle_s = self._gen_busy_s = 0.0
        self._published: _Published | None = None
        self._thread: threading.Thread | None = None
        self._calls: collections.deque = collections.deque()  # work for the generator thread
        self._should_stop: Callable[[bool], bool] = lambda waiting: False
        # with live moves, the last step whose move was decided: a batch waits for the step
        # before it, so a move is made before the next batch, not after it at the old split
        self._decided = -1

    # ------------------------------------------------------------------ generator side

    def _wait_for_version(self, batch: int) -> None:
        """Wait until batch `batch` may start: version `batch - lead` published (the lead is
        read again while waiting, so a lead raised meanwhile takes effect at once) and, with
        live moves, the step that published it has decided whether to move (else the swap
        would wait for this batch, made at the old split)."""
        pub = self._published
        with pub.cond:
            while pub.version < batch - self.lead or (
                    self.rebalance is not None and self._decided < batch - self.lead - 1):
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
                    future.set_result(fn(self.parts.generator, self._published.get))
                except BaseException as e:  # handed to the caller
                    future.set_exception(e)

    def call_on_generator(self, fn: Callable[[Any, Callable | None], Any]) -> Any:
        """Run `fn(generator, weights)` on the generator thread, between batches (or while it
        waits for weights), and return its result: work that needs the generator's engine
        mid-run (e.g. held-out evaluation with the newest published weights, `weights()`).
        Runs inline when the loop is not running (`weights` None before the first publish: the
        engine holds the weights it was built with)."""
        if self._thread is None:
            with self.trace.span("generator", getattr(fn, "__name__", "call")):
                return fn(self.parts.generator, self._published.get if self._published else None)
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

    def swap_parts(self, build: Callable[[Parts, int], Parts]) -> float:
        """Replace the parts at a step boundary: `build(parts, version) -> Parts` runs on the
        generator thread between batches while this thread waits; the new generator's weights
        are published as `version` before it starts another batch (batches already made are
        host data and stay queued). Returns the seconds both roles were paused."""
        start = time.perf_counter()

        def swap(generator, weights):
            version = weights()[1]  # the trainer's params are this version (published last)
            self.parts = build(self.parts, version)
            self._published.set(self.parts.generator.engine.params.state, version)

        self.call_on_generator(swap)
        return time.perf_counter() - start

    def _generator_loop(self, start: int, end: int) -> None:
        try:
            for b in range(start, end):
                self._serve_calls()
                t0 = time.perf_counter()
                self._wait_for_version(b)
                waited = time.perf_counter() - t0
                self._gen_idle_s += waited
                with self._ready_cond:  # its weights are this version or newer
                    self._started[b] = self._published.version
                if waited > 1e-3:
                    self.trace.add("generator", "wait_weights", self.trace.now() - waited, waited)
                t1 = time.perf_counter()
                with self.trace.span("generator", "produce", step=b):
                    produced = self.rollouts.produce(b, self.parts.generator.scheduler,
                                                     self._published.get)
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
            self._started.pop(step, None)
            return self._ready.pop(step)

    def _in_flight(self, steps_done: int) -> list[tuple[Produced, int]]:
        """The batches from `steps_done` on that the generator began with weights older than
        version `steps_done`, with that version, in step order (what a checkpoint after
        `steps_done` steps saves: a resume from it could not make them again); waits for any
        still being made."""
        with self._ready_cond:
            while True:
                steps = sorted(b for b, v in self._started.items()
                               if b >= steps_done and v < steps_done)
                missing = [b for b in steps if b not in self._ready]
                if not missing:
                    return [(self._ready[b], self._started[b]) for b in steps]
                if self._error is not None:
                    raise self._error
                if self._stop.is_set():
                    raise PipelineStopped(f"batches {missing}, begun before step {steps_done}'s "
                                          "checkpoint, were not finished")
                self._ready_cond.wait(self.poll_s)

    def _restore_in_flight(self, start_step: int) -> int:
        """Queue the batches the restored checkpoint held (the generator does not make them);
        returns the first batch the generator makes."""
        restored = self.checkpoints.follow(self._in_flight) if self.checkpoints else []
        steps = [produced.step for produced, _ in restored]
        if steps != list(range(start_step, start_step + len(steps))):
            raise RuntimeError(f"the checkpoint at step {start_step} holds batches {steps} in "
                               f"flight; expected consecutive batches from {start_step}")
        for produced, started in restored:
            self._ready[produced.step], self._started[produced.step] = produced, started
        if steps:
            log.info("resume: batch(es) %s were made before the checkpoint (from version %d); "
                     "trained as made, not generated again", steps, restored[0][1])
        return start_step + len(steps)

    def run(self, *, start_step: int, num_steps: int, first_row: dict | None = None,
            should_stop: Callable[[bool], bool] | None = None) -> Parts:
        """Run steps `start_step .. num_steps-1`; returns the parts in use at the end.

        The trainer's params are published as version `start_step` before the generator
        starts. `first_row`: columns of the first step's row (SFT metrics, the evaluation
        before RL). `should_stop(waiting)` is asked at the safe points, after each step
        (`waiting=False`) and while the trainer waits for a batch (True); when it says so, the
        run raises `StopRequested` with the steps finished (a batch not trained on is
        abandoned).
        """
        self._should_stop = should_stop or (lambda waiting: False)
        first_made = self._restore_in_flight(start_step)
        self._published = _Published(None, start_step - 1)
        self._decided = start_step - 1
        self._publish(self.parts.trainer.state.params, start_step)
        self._thread = threading.Thread(
            target=self._generator_loop, args=(first_made, num_steps), name="jaxrl-generator",
            daemon=True,
        )
        self._thread.start()
        try:
            for step in range(start_step, num_steps):
                row, samples = self._train_step(step)
                self._end_step(step, row, samples, end=step + 1 == num_steps,
                               first=first_row if step == start_step else None)
                if self._should_stop(False):
                    raise StopRequested(step + 1)
        except StopRequested as stop:  # the batches in flight finished, for the checkpoint
            try:
                if self.checkpoints is not None:
                    self._in_flight(stop.steps_done)
            finally:
                self.stop(timeout_s=10.0, abandon=True)
            raise
        except BaseException:  # an error or Ctrl-C: a stuck generator is reported, not waited on
            self.stop(timeout_s=10.0, abandon=True)
            raise
        self.stop()
        return self.parts

    def _train_step(self, step: int) -> tuple[dict, list]:
        """Rollout → update → sync; returns the step's row and the batch's samples."""
        window_start = time.perf_counter()
        idle0, busy0 = self._gen_idle_s, self._gen_busy_s
        with self.trace.span("trainer", "wait_batch", step=step):
            batch = self._wait_for_batch(step)  # 1. rollout (made by the generator thread)
        waited = time.perf_counter() - window_start
        t0 = time.perf_counter()
        if self.lead == 0:
            self._release_generator()
        trainer = self.parts.trainer
        with self.trace.span("trainer", "train_step", step=step):
            metrics = self.update(step, batch, trainer)  # 2. update
        if self._lead_rule is not None:
            self.lead = min(max(int(self._lead_rule()), 0), self._max_lead)
        metrics.update(self._publish(trainer.state.params, step + 1))  # 3. sync
        train_s = time.perf_counter() - t0
        window = time.perf_counter() - window_start
        rollouts = metrics.get("pipeline/batch_size", batch.num_rollouts)
        metrics.update({
            "pipeline/step_s": window,
            "pipeline/trainer_idle_frac": waited / window,
            "pipeline/generator_idle_frac": min(1.0, (self._gen_idle_s - idle0) / window),
            "pipeline/rollouts_per_s_consumed": rollouts / train_s,
            "pipeline/rollouts_per_s_produced": rollouts / max(batch.busy_s, 1e-9),
            "pipeline/generator_busy_s": self._gen_busy_s - busy0,
            "pipeline/trainer_busy_s": train_s,
            "pipeline/trainer_chips": float(self.parts.trainer_chips),
            "pipeline/generator_chips": float(self.parts.generator_chips),
            "pipeline/mode": self.mode,
            "staleness/lead": float(self.lead),
        })
        metrics.update(self.row_metrics())
        return self.reduce(metrics), batch.samples

    def _end_step(self, step: int, row: dict, samples: list, *, end: bool,
                  first: dict | None) -> None:
        """Hooks (order-free) and a live move add to the completed row (and `first`, the
        columns of the run's first row, where no hook set them); then the row is logged and
        the checkpoint written."""
        record = StepRecord(step, step + 1, end, MappingProxyType(dict(row)),
                            self.call_on_generator)
        row.update(run_hooks(self.hooks, record))
        for key, value in (first or {}).items():
            row.setdefault(key, value)
        if self.rebalance is not None:
            added, build = self.rebalance.plan(record, self.parts)
            row.update(added)
            if build is not None:
                row.update(self.rebalance.moved(self.swap_parts(build)))
            with self._published.cond:
                self._decided = step
                self._published.cond.notify_all()
        self.log_row(step, row, samples)
        if self.checkpoints is not None and self.checkpoints.due(step + 1, end):
            self.checkpoints.save(step + 1, self.parts.trainer)

    def _release_generator(self) -> None:
        """Lead 0: the generator waits for this update's weights, so the published ones (and
        the engine's copy and KV cache) are not needed until the next publish; freeing them
        makes room for the update. The generator thread is idle here: it made this step's batch
        and may start no other before the next publish, and the calls it serves
        (`call_on_generator`) come from this thread, between steps."""
        with self.trace.span("generator", "release"):
            self._published.set(None, self._published.version)
            self.rollouts.release(self.parts.generator.scheduler)

    def _publish(self, params: Any, version: int) -> dict:
        start = self.trace.now()
        gen_params, metrics = self.parts.generator.publisher.publish(params, version)
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
