"""Compile the next split before moving (`pipeline.rebalance`, jaxrl/rl/rebalance.py).

When the policy names a candidate split, `Ahead` builds what the move will need on a background
thread while the current split keeps running: the trainer's step compiled for the new trainer
mesh (`jaxrl.train.trainer.precompile_step`) and the generator built on the new generator mesh
with its engine's executables compiled (`JaxEngine.precompile`), its weights then released until
the move publishes the current ones. The move waits for nothing: it is made only once `ready()`.

`CompileCounter` counts XLA compilations (jax's monitoring events), so
a test or a log line can say that a move to a split compiled before compiled nothing.
`use_compile_cache` turns on XLA's persistent compilation cache for a run (`compile_cache`), so
a split met in an earlier run, or a restart, loads its executables.
"""

from __future__ import annotations

import json
import os
import threading
import time
from collections.abc import Callable
from typing import Any

import jax

# recorded once per executable XLA compiled or loaded from the persistent compilation cache
# (an executable reused from memory records nothing)
COMPILE_EVENT = "/jax/core/compile/backend_compile_duration"
CACHE_HIT_EVENT = "/jax/compilation_cache/cache_hits"
SAVED_EVENT = "/jax/compilation_cache/compile_time_saved_sec"  # a hit's compile time spared


class CompileCounter:
    """Counts the executables compiled (or loaded from the persistent cache: `cache_hits` of
    them) while active (`with CompileCounter() as c: ...; c.count`), on every thread.
    `seconds`: their compile (or load) time; `saved_s`: the compile time the cache hits spared
    (as recorded when they were compiled)."""

    def __init__(self):
        self.count, self.cache_hits, self.seconds, self.saved_s = 0, 0, 0.0, 0.0
        self._lock = threading.Lock()

    def _duration(self, event: str, duration: float, **_) -> None:
        if event == COMPILE_EVENT:
            with self._lock:
                self.count, self.seconds = self.count + 1, self.seconds + duration
        elif event == SAVED_EVENT:
            with self._lock:
                self.saved_s += max(0.0, duration)

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


def use_compile_cache(path: str) -> None:
    """XLA's persistent compilation cache in `path` (a run's `compile_cache`), unless one is set
    already (JAX_COMPILATION_CACHE_DIR, or the caller's `jax.config`) or `path` is ""."""
    from pathlib import Path

    if path and not jax.config.jax_compilation_cache_dir:
        jax.config.update("jax_compilation_cache_dir", str(Path(path).expanduser()))


class CompiledSplits:
    """What a persistent compilation cache holds for one run's programs (`fingerprint`: what the
    executables depend on), in a small JSON file beside the cache (`jaxrl-compiled-splits.json`):
    the splits compiled into it, so the rebalancing policy knows which split loads instead of
    compiling, and the longest compile-ahead measured that compiled (wall seconds, and seconds
    it slowed the running steps; one cut short by the run's end counts what it had taken), so a
    later run does not assume a compilation cheaper than one already seen. No cache directory:
    knows nothing. A stale entry (the cache pruned) only makes an estimate optimistic; a move
    still waits for its compile-ahead."""

    FILE = "jaxrl-compiled-splits.json"

    def __init__(self, cache_dir: str | None, fingerprint: str):
        self.path = None if not cache_dir else os.path.join(cache_dir, self.FILE)
        self.fingerprint = fingerprint
        self._lock = threading.Lock()  # a compile-ahead thread adds its split

    def _entry(self) -> dict:
        try:
            with open(self.path) as f:
                entry = json.load(f).get(self.fingerprint, {})
            return entry if isinstance(entry, dict) else {}
        except (OSError, ValueError, AttributeError):
            return {}

    def known(self, key) -> bool:
        return self.path is not None and str(key) in self._entry().get("splits", [])

    def compile_s(self) -> tuple[float, float] | None:
        """(wall, cost) of the longest compiling compile-ahead recorded, if any."""
        got = self.path is not None and self._entry().get("compile_s")
        return (float(got[0]), float(got[1])) if got else None

    def add(self, key) -> None:
        self._update(lambda e: e.update(splits=sorted({*e.get("splits", []), str(key)})))

    def compiled(self, wall_s: float, cost_s: float) -> None:
        """A compile-ahead that compiled took `wall_s` (at least) and slowed the steps by
        `cost_s`: kept if longer than the one recorded."""
        def keep(e):
            old = e.get("compile_s") or (0.0, 0.0)
            e["compile_s"] = [max(old[0], wall_s), max(old[1], cost_s)]
        self._update(keep)

    def _update(self, change) -> None:
        if self.path is None:
            return
        with self._lock:
            try:
                with open(self.path) as f:
                    data = json.load(f)
            except (OSError, ValueError):
                data = {}
            data = data if isinstance(data, dict) else {}
            entry = data.get(self.fingerprint)
            entry = entry if isinstance(entry, dict) else {}
            change(entry)
            data[self.fingerprint] = entry
            try:
                os.makedirs(os.path.dirname(self.path), exist_ok=True)
                tmp = f"{self.path}.{os.getpid()}.{threading.get_native_id()}.tmp"
                with open(tmp, "w") as f:
                    json.dump(data, f)
                os.replace(tmp, self.path)  # readers see the old file or the new one
            except OSError:  # a read-only cache: the estimates stay the run's own
                pass
