"""The prompt stream of a run: grain order (shard, seeded shuffle, epochs) + grouping into steps.

    it = PromptIterator(task.source("train"), prompts_per_step=8, seed=0, epochs=1,
                        process_index=jax.process_index(), process_count=jax.process_count())
    batch = next(it)                  # list of 8 records; the generator samples group_size each
    ckpt.register("data", get=it.get_state, set=it.set_state)   # JSON round trip

Order: `source[process_index::process_count]` (disjoint shards covering the source) -> grain
`shuffle(seed)` (a fresh permutation per epoch) -> `repeat(epochs)` (0 = forever). The order is a
pure function of (seed, shard, position), so a restored iterator continues exactly where the saved
one stopped: no prompt repeats or is skipped. Batches run across epoch boundaries; when the
stream ends, a final partial batch is dropped (`StopIteration`).

Dynamic sampling: with a `SolveRateTracker`, prompts it says to skip (always / never solved) are
passed over while filling a batch; they are counted (`data/skipped_prompts`). Skipping depends on
the tracker's state, so save it alongside (`tracker.get_state()`, its own checkpoint extra).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Sequence
from typing import Any

import grain

STATE_VERSION = 1


class PromptIterator:
    """Batches of records from a random-access source; checkpointable (`get_state`/`set_state`).

    Args:
      source: records (`len`, `[i]`), e.g. `task.source("train")`.
      prompts_per_step: records per batch.
      seed: shuffle seed (the same seed gives the same order).
      epochs: passes over this process's shard; 0 repeats forever.
      process_index / process_count: this process's shard of the source.
      tracker: optional `SolveRateTracker`; prompts it marks to skip are passed over.
    """

    def __init__(
        self,
        source: Sequence[dict],
        *,
        prompts_per_step: int,
        seed: int = 0,
        epochs: int = 1,
        shuffle: bool = True,
        process_index: int = 0,
        process_count: int = 1,
        tracker=None,
    ):
        if not 0 <= process_index < process_count:
            raise ValueError(f"process_index={process_index} must be in [0, process_count="
                             f"{process_count})")
        if prompts_per_step < 1 or epochs < 0:
            raise ValueError(f"prompts_per_step must be >= 1 and epochs >= 0; got "
                             f"{prompts_per_step}, {epochs}")
        if len(source) < process_count:
            raise ValueError(f"source has {len(source)} records, fewer than process_count="
                             f"{process_count}: some process would get none")
        self.source = source
        self.prompts_per_step = prompts_per_step
        self.epochs = epochs
        self.tracker = tracker
        ds = grain.MapDataset.source(source)[process_index::process_count]
        self.shard_size = len(ds)
        if shuffle:
            ds = ds.shuffle(seed=seed)
        ds = ds.repeat(epochs or None)
        self._ds = ds.to_iter_dataset()
        self._it = iter(self._ds)
        self._fingerprint = _fingerprint(
            dict(n=len(source), seed=seed, epochs=epochs, shuffle=shuffle, shard=process_index,
                 shards=process_count, name=str(getattr(source, "name", "")))
        )
        self.consumed = 0  # records drawn from grain (including skipped ones)
        self.skipped = 0
        self.steps = 0

    def __iter__(self) -> PromptIterator:
        return self

    def batches_left(self) -> int | None:
        """Whole batches the stream still holds (None: it repeats forever); prompts skipped by
        the tracker make the real number smaller."""
        if not self.epochs:
            return None
        return (self.shard_size * self.epochs - self.consumed) // self.prompts_per_step

    def __next__(self) -> list[dict]:
        batch: list[dict] = []
        run_of_skips = 0
        while len(batch) < self.prompts_per_step:
            record = next(self._it)  # StopIteration ends the stream (partial batch dropped)
            self.consumed += 1
            if self.tracker is not None and self.tracker.should_skip(record["uid"]):
                self.skipped += 1
                run_of_skips += 1
                if run_of_skips > self.shard_size:
                    raise RuntimeError(
                        f"every one of the {self.shard_size} prompts of this shard is skipped by "
                        "the solve-rate tracker (always or never solved); turn off "
                        "data.skip_solved / data.skip_unsolved or use a harder/easier task")
                continue
            run_of_skips = 0
            batch.append(record)
        self.steps += 1
        return batch

    @property
    def epoch(self) -> float:
        """Fractional epochs consumed of this process's shard."""
        return self.consumed / self.shard_size

    def get_state(self) -> dict[str, Any]:
        """JSON-able state: grain's iterator state + counters. A tracker's state is NOT part of it:
        save `tracker.get_state()` as its own checkpoint extra."""
        state = {
            "version": STATE_VERSION,
            "fingerprint": self._fingerprint,
            "grain": self._it.get_state(),
            "consumed": self.consumed,
            "skipped": self.skipped,
            "steps": self.steps,
        }
        return json.loads(json.dumps(state))  # fail here, not in the checkpointer, if not JSON

    def set_state(self, state: dict[str, Any]) -> None:
        if state.get("version") != STATE_VERSION:
            raise ValueError(f"data iterator state version {state.get('version')!r}; this code "
                             f"reads version {STATE_VERSION}")
        if state["fingerprint"] != self._fingerprint:
            raise ValueError(
                "data iterator state was saved for a different dataset/order (source size, seed, "
                "epochs, shuffle or process sharding changed); refusing to resume it silently"
            )
        self._it.set_state(state["grain"])
        self.consumed, self.skipped = state["consumed"], state["skipped"]
        self.steps = state["steps"]

    def metrics(self) -> dict[str, float]:
        m = {"data/epoch": self.epoch, "data/skipped_prompts": float(self.skipped),
             "data/prompts_consumed": float(self.consumed)}
        bad = getattr(self.source, "bad_records", None)
        if bad is not None:
            m["data/bad_records"] = float(bad)
        return m


def _fingerprint(d: dict) -> str:
    return hashlib.sha256(json.dumps(d, sort_keys=True).encode()).hexdigest()[:16]


def prompt_iterator(task, cfg, *, process_index: int = 0, process_count: int = 1,
                    tracker=None) -> PromptIterator:
    """The training prompt stream of `task` as configured by `cfg` (a DataConfig)."""
    return PromptIterator(
        task.source("train"), prompts_per_step=cfg.prompts_per_step, seed=cfg.seed,
        epochs=cfg.epochs, shuffle=cfg.shuffle, process_index=process_index,
        process_count=process_count, tracker=tracker,
    )
