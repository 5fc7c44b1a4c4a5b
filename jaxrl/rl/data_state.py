"""`DataStates`: the prompt iterator's and solve-rate tracker's state as of the last TRAINED batch.

The generator thread runs ahead of the trainer (by `ahead` batches), so the iterator's live state
is past the batches a checkpoint covers. The producer records the state after drawing each batch
(`record(step)`); the trainer side commits a step once it has trained on it (`commit(step)`); a
checkpoint saves the committed state, so `--resume` neither repeats nor skips prompts. With several
processes, `share()` gathers every process's committed state before a save (a collective).
"""

from __future__ import annotations

import threading

from jaxrl.config import ConfigError


class DataStates:
    def __init__(self, prompts, tracker, processes):
        self.prompts, self.tracker, self.processes = prompts, tracker, processes
        self._lock = threading.Lock()
        self._recorded: dict[int, tuple] = {}
        self._committed = self._now()
        self._shared = [self._committed]

    def _now(self) -> tuple:
        return self.prompts.get_state(), self.tracker.get_state()

    def record(self, step: int) -> None:
        """Generator thread: batch `step` has been drawn (and its rewards fed to the tracker)."""
        state = self._now()
        with self._lock:
            self._recorded[step] = state

    def commit(self, step: int) -> None:
        """Trainer thread: batch `step` was trained on."""
        with self._lock:
            self._committed = self._recorded.pop(step, self._committed)
            for old in [s for s in self._recorded if s < step]:
                del self._recorded[old]

    def share(self) -> None:
        """Every process's committed state, for the next checkpoint (collective)."""
        self._shared = self.processes.gather(self._committed)

    def reset(self) -> None:
        """After a restore: the restored state is the committed one."""
        self._committed = self._now()
        self._shared = self.processes.gather(self._committed)

    def register(self, checkpointer) -> None:
        checkpointer.register("data", get=lambda: self._value(0),
                              set=lambda v: self.prompts.set_state(self._own(v, "data")))
        checkpointer.register("tracker", get=lambda: self._value(1),
                              set=lambda v: self.tracker.set_state(self._own(v, "tracker")))

    def _value(self, i: int):
        if not self.processes.multi:
            return self._committed[i]
        return {"processes": [s[i] for s in self._shared]}

    def _own(self, value, name: str):
        per_process = isinstance(value, dict) and set(value) == {"processes"}
        written_by = len(value["processes"]) if per_process else 1
        if written_by != self.processes.count:
            raise ConfigError(
                f"the checkpoint's {name} state was written by {written_by} process(es); resume "
                f"with the same number (this run has {self.processes.count})")
        return value["processes"][self.processes.index] if per_process else value
