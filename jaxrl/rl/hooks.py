"""What runs around the steps: hooks that add to a step's row, and the checkpoints.

A hook is `fn(record) -> dict`: it receives the step's `StepRecord` (the row as the loop
completed it, read-only) and returns the columns it adds. Hooks run after the row is complete
and before it is logged; none sees another's additions and none shares state with another, so
their order does not matter (tests/rl/test_hooks.py registers them shuffled). Two hooks adding
the same column is an error.

    Hook(fn, every=n)       at steps_done = n, 2n, ...; every=0: only at the end of the run
    Hook(fn, at_end=True)   also at the end (once, when the end falls on a multiple of n)

The run's hooks: `eval_hook` (held-out evaluation mid-run and at the end). The checkpoint is
not a hook: it is written after the row it covers (`Checkpoints`, called by the loop), so a
stop between the two never loses a row on resume; `open_checkpoints` opens them (and resumes).
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Callable, Mapping
from typing import Any

from jaxrl.rl.metrics import rewind_logs
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.init import register_lora_base

log = logging.getLogger("jaxrl")


@dataclasses.dataclass(frozen=True)
class StepRecord:
    """One step as hooks see it."""

    step: int  # the batch trained on
    steps_done: int  # step + 1
    end: bool  # the run's last step
    row: Mapping[str, Any]  # the completed metrics row (read-only)
    on_generator: Callable  # `Loop.call_on_generator`: work that needs the generator's engine


@dataclasses.dataclass(frozen=True)
class Hook:
    fn: Callable[[StepRecord], dict | None]
    every: int = 1
    at_end: bool = False

    def __post_init__(self):
        if self.every < 0:
            raise ValueError(f"hook every={self.every}: must be >= 0 (0 = only at the end)")

    def due(self, steps_done: int, end: bool) -> bool:
        if end and (self.at_end or self.every == 0):
            return True
        return self.every > 0 and steps_done % self.every == 0


def run_hooks(hooks: list[Hook], record: StepRecord) -> dict:
    """The columns the due hooks add to `record.row` (each hook sees only the completed row)."""
    added: dict = {}
    for hook in hooks:
        if hook.due(record.steps_done, record.end):
            new = hook.fn(record) or {}
            clash = sorted((set(new) & set(added)) | (set(new) & set(record.row)))
            if clash:
                raise ValueError(f"hook {hook.fn!r} adds columns already present: {clash}")
            added.update(new)
    return added


def eval_hook(evaluator, *, every: int, start_done: bool) -> Hook:
    """Held-out evaluation every `every` steps (0: none mid-run) and at the end, on the
    generator's engine with the newest published weights. `start_done`: row 0 already holds
    the before-RL evaluation (then steps_done=1 is not evaluated again)."""

    def evaluate(record: StepRecord) -> dict:
        if not record.end and record.steps_done == 1 and start_done:
            return {}
        return evaluator(record.steps_done, on_generator=record.on_generator)

    return Hook(evaluate, every=every, at_end=True)


class Checkpoints:
    """The run's checkpoints: every `train.checkpoint_every` steps and at the end; each covers
    the data iterator's state as of the batches trained (`DataStates`) and the batches the
    loop made from older weights but has not trained on yet (jaxrl/rl/in_flight.py)."""

    def __init__(self, ckpt: Checkpointer, data_states):
        self.ckpt, self.data_states = ckpt, data_states
        self._in_flight: Callable[[int], list] = lambda steps_done: []

    def follow(self, in_flight: Callable[[int], list]) -> list:
        """The loop's batches in flight, `in_flight(steps_done) -> [(Produced, version started
        with)]`, saved with each checkpoint from now on; returns those the restored checkpoint
        held (empty on a fresh run), which the loop trains on instead of generating them."""
        self._in_flight = in_flight
        return self.data_states.take_restored()

    def due(self, steps_done: int, end: bool) -> bool:
        return end or (self.ckpt.every > 0 and steps_done % self.ckpt.every == 0)

    def save(self, steps_done: int, trainer) -> None:
        batches = self._in_flight(steps_done)  # waits for any still being made
        self.ckpt.wait()  # the previous checkpoint is complete before the next starts
        self.data_states.share(batches)
        self.ckpt.save(trainer.state, step=steps_done)


def open_checkpoints(cfg, run_dir, trainer, data_states, processes, closers, *,
                     resume: bool) -> tuple[Checkpoints, int]:
    """The run's checkpoints and the step to start from: with `resume`, the newest intact
    checkpoint restored into `trainer` (checkpoints are numbered by steps done; later rows of
    metrics.jsonl, samples.jsonl and TensorBoard dropped); then a check that two checkpoints
    fit on the disk."""
    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.train.checkpoint_every,
                        keep=cfg.train.checkpoint_keep)
    closers.callback(ckpt.close)
    data_states.register(ckpt)
    register_lora_base(ckpt, trainer, cfg)
    start_step = 0
    if resume:
        start_step, state = ckpt.restore_newest(trainer.abstract_state)  # skips damaged ones
        trainer.replace_state(state)
        log.info("resumed %s from its checkpoint at step %d (steps %d.. run again)",
                 run_dir.name, start_step, start_step)
        if processes.leader:
            rewind_logs(run_dir, start_step)
    data_states.reset()
    ckpt.check_space(trainer.state)  # room for two checkpoints, before any step
    return Checkpoints(ckpt, data_states), start_step
