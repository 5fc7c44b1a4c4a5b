"""`DataStates`: what a checkpoint holds of the data: the prompt iterator's and solve-rate
tracker's state, and the batches drawn and generated but not yet trained on.

The generator thread runs ahead of the trainer (by the lead), so the iterator's live state is past
the batches a checkpoint covers. The producer records the state after drawing each batch
(`record(step)`); the trainer side commits a step once it has trained on it (`commit(step)`). A
checkpoint saves the committed state, or, when batches made from older weights are in flight
(jaxrl/rl/in_flight.py), those batches and the state after the last of them; so `--resume` neither
repeats nor skips prompts, and trains on the rollouts the uninterrupted run trained on. With
several processes, `share()` gathers every process's state before a save (a collective).
"""

from __future__ import annotations

import threading

from jaxrl.config import ConfigError
from jaxrl.rl import in_flight


class DataStates:
    def __init__(self, prompts, tracker, processes):
        self.prompts, self.tracker, self.processes = prompts, tracker, processes
        self._lock = threading.Lock()
        self._recorded: dict[int, tuple] = {}
        self._committed = self._now()
        self._shared = [(*self._committed, [])]
        self._restored: list[tuple] = []  # (Produced, version started with) from the checkpoint

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

    def share(self, batches: list[tuple] = ()) -> None:
        """Every process's state for the next checkpoint (collective): the committed one, or
        with `batches` in flight ((Produced, version started with), in step order) the state
        after the last of them, and the batches."""
        with self._lock:
            state = self._recorded[batches[-1][0].step] if batches else self._committed
        records = [in_flight.encode(produced, started) for produced, started in batches]
        self._shared = self.processes.gather((*state, records))

    def reset(self) -> None:
        """After a restore (or none): the restored state is the committed one; with batches
        restored, it is the state after the last of them."""
        self._committed = self._now()
        if self._restored:
            self._recorded[self._restored[-1][0].step] = self._committed
        self._shared = self.processes.gather((*self._committed, []))

    def take_restored(self) -> list[tuple]:
        """The batches in flight at the restored checkpoint ((Produced, version started with),
        in step order; empty on a fresh run), once."""
        restored, self._restored = self._restored, []
        return restored

    def register(self, checkpointer) -> None:
        checkpointer.register("data", get=lambda: self._value(0),
                              set=lambda v: self.prompts.set_state(self._own(v, "data")))
        checkpointer.register("tracker", get=lambda: self._value(1),
                              set=lambda v: self.tracker.set_state(self._own(v, "tracker")))
        # a checkpoint written before batches in flight were saved (2026-12-05) has none
        checkpointer.register("in_flight", get=lambda: self._value(2), missing=None, set=lambda v:
                              self._set_in_flight([] if v is None else self._own(v, "in_flight")))

    def _set_in_flight(self, records: list[dict]) -> None:
        self._restored = [in_flight.decode(r) for r in records]

    def _value(self, i: int):
        if not self.processes.multi:
            return self._shared[0][i]
        return {"processes": [s[i] for s in self._shared]}

    def _own(self, value, name: str):
        per_process = isinstance(value, dict) and set(value) == {"processes"}
        written_by = len(value["processes"]) if per_process else 1
        if written_by != self.processes.count:
            raise ConfigError(
                f"the checkpoint's {name} state was written by {written_by} process(es); resume "
                f"with the same number (this run has {self.processes.count})")
        return value["processes"][self.processes.index] if per_process else value
