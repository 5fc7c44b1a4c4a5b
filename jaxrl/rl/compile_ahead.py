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

# recorded once per executable XLA compiled or loaded from the persistent compilation cache
# (an executable reused from memory records nothing)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"


class CompileCounter:
    """Counts the executables compiled (or loaded from the persistent cache: `cache_hits` of
    them) while active (`with CompileCounter() as c: ...; c.count`), on every thread."""

    def __init__(self):
        self.count, self.cache_hits, self.seconds = 0, 0, 0.0
        self._lock = threading.Lock()

    def _duration(self, event: str, duration: float, **_) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self.count, self.seconds = self.count + 1, self.seconds + duration

    def _event(self, event: str, **_) -> None:
        if event == CACHE_HIT_EVENT:
            with self._lock:
                self.cache_hits += 1

    def __enter__(self) -> CompileCounter:
        jax.monitoring.register_event_duration_secs_listener(self._duration)
        jax.monitoring.register_event_listener(self._event)
        return self

    def __exit__(self, *exc) -> None:
        jax.monitoring.unregister_event_duration_listener(self._duration)
        jax.monitoring.unregister_event_listener(self._event)


class Ahead:
    """`work()` on a background thread; `ready()` without blocking, `result()` blocking
    (re-raising its error). Not a daemon: a run that ends first waits for it at exit (a
    compilation cut off by the interpreter's exit aborts the process). `seconds`: the thread's
    wall time once done; `compiles` and `cache_hits`: the executables compiled meanwhile and
    how many of them the persistent cache held (on any thread: the running steps' own included,
    which after the first step are none)."""

    def __init__(self, key: Any, work: Callable[[], Any]):
        self.key, self.seconds, self.compiles, self.cache_hits = key, None, 0, 0
        self._result: Any = None
        self._error: BaseException | None = None
        self._done = threading.Event()
        self.started = time.perf_counter()
        self._thread = threading.Thread(target=self._run, args=(work,), daemon=False,
                                        name=f"jaxrl-compile-ahead-{key}")
        self._thread.start()

    def _run(self, work) -> None:
        try:
            with CompileCounter() as counter:
                self._result = work()
            self.compiles, self.cache_hits = counter.count, counter.cache_hits
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
