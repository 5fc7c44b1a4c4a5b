"""Compile the next split before moving (`pipeline.rebalance`, jaxrl/rl/rebalance.py).

When the policy names a candidate split, `Ahead` builds what the move will need on a background
thread while the current split keeps running: the trainer's step compiled for the new trainer
mesh (`jaxrl.train.trainer.precompile_step`) and the generator built on the new generator mesh
with its engine's executables compiled (`JaxEngine.precompile`), its weights then released until
the move publishes the current ones. The move waits for nothing: it is made only once `ready()`.

`CompileCounter` counts XLA compilations (jax's monitoring events), so a test or a log line can
say that a move to a split compiled before compiled nothing.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

import jax

# recorded once per backend compilation (a persistent-cache hit records a cache event instead)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"


class CompileCounter:
    """Counts backend compilations while active (`with CompileCounter() as c: ...; c.count`),
    on every thread."""

    def __init__(self):
        self.count, self.seconds = 0, 0.0
        self._lock = threading.Lock()

    def _listener(self, event: str, duration: float, **_) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self.count, self.seconds = self.count + 1, self.seconds + duration

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._listener)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._listener)


class Ahead:
    """`work()` on a background thread (daemon: a run that ends first does not wait for it);
    `ready()` without blocking, `result()` blocking (re-raising its error). `seconds`: the
    thread's wall time once done; `compiles`: the backend compilations made meanwhile (on any
    thread: the running step's own included, which after the first step are none)."""

    def __init__(self, key: Any, work: Callable[[], Any]):
        self.key, self.seconds, self.compiles = key, None, 0
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=True,
                                        name=f"jaxrl-compile-ahead-{key}")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            with CompileCounter() as counter:
                self._result = work()
            self.compiles = counter.count
        except BaseException as e:  # handed to whoever asks for the result
            self._error = e
        finally:
            self.seconds = time.perf_counter() - self.started
            self._done.set()

    def ready(self) -> bool:
        return self._done.is_set()

    def result(self, timeout_s: float | None = None) -> Any:
        if not self._done.wait(timeout_s):
            raise TimeoutError(f"compile-ahead of {self.key} not done after {timeout_s}s")
        if self._error is not None:
            raise self._error
        return self._result
