"""Checkpoints (orbax): the whole `TrainState` plus opaque JSON state other parts register.

    ckpt = Checkpointer(run_dir / "checkpoints", every=100, keep=3)
    ckpt.register("data", get=lambda: it.get_state(), set=it.set_state)   # any JSON-able state
    ckpt.maybe_save(trainer.state, step=s)  # every `every` steps, asynchronous
    state = ckpt.restore(abstract_state)    # latest; shardings taken from `abstract_state`
    step, state = ckpt.restore_newest(abstract_state)  # the newest complete one (--resume)
    ckpt.check_space(state)                 # room for two checkpoints, else DiskSpaceError

Saving is asynchronous: the arrays are copied off the devices, then written in the background
while training continues (`wait()` blocks until written). Restore reads each array straight into
the sharding of the given abstract state, so a checkpoint written from one trainer-mesh shape
restores onto another. Each step is sealed with a record of its files' sizes and checksums
before orbax gives it its final name (`checkpoint_integrity`); `restore_newest` skips a damaged
step, says why, and moves it aside to `<run>/damaged_checkpoints/`. A disk that fills during a
write is one `DiskSpaceError` line (the step, the free space, the last complete checkpoint),
the partial step removed. `export_hf` writes the policy as a Hugging Face directory.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import math
import shutil
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import numpy as np
import orbax.checkpoint as ocp

from jaxrl.config import ConfigError
from jaxrl.config.resume import restore_error
from jaxrl.train import checkpoint_integrity as integrity
from jaxrl.train.state import TrainState

log = logging.getLogger("jaxrl")


_REQUIRED = object()  # register(missing=...) not given

class CheckpointError(ConfigError):
    """No checkpoint of a run can be restored; the message says why for each."""


class NoUsableCheckpoint(CheckpointError):
    """`restore_newest` found no checkpoint that is complete and loads (`skipped`: each step
    and why); nothing was changed."""

    def __init__(self, message: str, skipped: list[tuple[int, str]]):
        super().__init__(message)
        self.skipped = skipped


class DiskSpaceError(CheckpointError):
    """Too little free space for the checkpoints; nothing was written, earlier ones are kept."""


DISK_FULL = (errno.ENOSPC, errno.EDQUOT)


def disk_full(error: BaseException | None) -> bool:
    """`error`, or an exception it wraps (cause, context, group), is a full disk or quota."""
    seen = set()
    stack = [error]
    while stack:
        e = stack.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, OSError) and e.errno in DISK_FULL:
            return True
        stack += [e.__cause__, e.__context__, *getattr(e, "exceptions", ())]
    return False


class _QuietDiskFull(logging.Filter):
    """Drops orbax's (and asyncio's) logged tracebacks of a full disk: the Checkpointer raises
    one `DiskSpaceError` line for it instead of hundreds of lines."""

    def filter(self, record: logging.LogRecord) -> bool:
        exc = record.exc_info[1] if record.exc_info else None
        return not (disk_full(exc) or "No space left on device" in record.getMessage())


_QUIET = _QuietDiskFull()


def free_bytes(directory: Path) -> int:
    """Free bytes on the filesystem of `directory` (tests replace this probe)."""
    return shutil.disk_usage(directory).free


def state_bytes(state) -> int:
    """Bytes of every array of `state` (concrete or abstract): one checkpoint, uncompressed."""
    return sum(math.prod(x.shape) * np.dtype(x.dtype).itemsize
               for x in jax.tree.leaves(state) if hasattr(x, "shape"))


class Checkpointer:
    def __init__(self, directory: str | Path, *, every: int, keep: int, use_async: bool = True):
        if every < 0 or keep < 1:
            raise ValueError(f"checkpoint every must be >= 0 and keep >= 1; got {every}, {keep}")
        self.directory = Path(directory).absolute()
        self.every = every
        self._use_async = use_async
        self._sealing: int | None = None  # the step being saved, sealed before its rename
        self._writing: int | None = None  # the step being written (until a wait saw it done)
        for name in ("absl", "asyncio"):  # a full disk is one line (_disk_full_error)
            if _QUIET not in logging.getLogger(name).filters:
                logging.getLogger(name).addFilter(_QUIET)
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=max(every, 1),
            enable_async_checkpointing=use_async,
            async_options=ocp.AsyncOptions(post_finalization_callback=self._seal)
            if use_async else None,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._extras: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}
        self._missing: dict[str, Any] = {}  # what an older checkpoint without an extra means

    def register(self, name: str, *, get: Callable[[], Any], set: Callable[[Any], None],
                 missing: Any = _REQUIRED) -> None:
        """Save `get()` (JSON-able) with every checkpoint; `set(value)` it back on restore. An
        extra added after checkpoints were written gives `missing`: a checkpoint without it
        is then still whole and restores with `set(missing)` (without one, it is damaged)."""
        if name in self._extras:
            raise ValueError(f"checkpoint extra {name!r} registered twice")
        self._extras[name] = (get, set)
        if missing is not _REQUIRED:
            self._missing[name] = missing

    def _save_args(self, state: TrainState):
        extra = {name: get() for name, (get, _) in self._extras.items()}
        return ocp.args.Composite(
            state=ocp.args.StandardSave(state), extra=ocp.args.JsonSave(extra)
        )

    def maybe_save(self, state: TrainState, *, step: int | None = None,
                   force: bool = False) -> bool:
        """Save as `step` (default `state.step`, the updates applied) if it is a multiple of
        `every` (or `force`); returns whether it did. A run numbers its checkpoints by pipeline
        steps, which differ from `state.step` once an update was skipped (nan_policy="skip")."""
        step = int(jax.device_get(state.step)) if step is None else int(step)
        if not force and (self.every == 0 or step % self.every):
            return False
        if step in self._manager.all_steps():
            return False
        self.check_space(state)
        self.wait()  # one save in flight: `_seal` knows which
        self._sealing = self._writing = step
        with self._one_line_if_disk_full(finished=False):
            saved = self._manager.save(step, args=self._save_args(state), force=True)
            if saved and not self._use_async:
                self._seal()
        return saved

    @contextlib.contextmanager
    def _one_line_if_disk_full(self, *, finished: bool = True):
        """A write that fails on a full disk (here, or in orbax's background thread, seen at
        the next wait) raises one `DiskSpaceError` naming the step, the free space and the
        last complete checkpoint; the partial step is removed."""
        try:
            yield
        except Exception as e:
            if not disk_full(e):
                raise
            raise self._disk_full_error(e) from None
        if finished:
            self._writing = None

    def _disk_full_error(self, error: BaseException) -> DiskSpaceError:
        step, self._writing, self._sealing = self._writing, None, None
        if jax.process_index() == 0:  # the partial step: orbax would skip it; free its space
            for tmp in self.directory.glob(f"{step}.orbax-checkpoint-tmp*"):
                shutil.rmtree(tmp, ignore_errors=True)
        complete = sorted(int(p.name) for p in self.directory.iterdir()
                          if p.name.isdigit() and int(p.name) != step)
        kept = (f"nothing is lost: the last complete checkpoint is step {complete[-1]}, "
                "--resume continues from it" if complete else "no earlier checkpoint exists")
        return DiskSpaceError(
            f"checkpoint step {step} could not be written: the disk is full ({error}); "
            f"{free_bytes(self.directory):,} bytes free in {self.directory}; {kept}; free space "
            "there (or set --run_dir elsewhere)")

    def check_space(self, state, copies: int = 2) -> None:
        """Raise `DiskSpaceError` unless the filesystem has room for `copies` checkpoints of
        `state` (a run checks before it starts and before each save)."""
        need, free = copies * state_bytes(state), free_bytes(self.directory)
        if free < need:
            kept = self.all_steps()
            raise DiskSpaceError(
                f"not enough free space for checkpoints in {self.directory}: {free:,} bytes free, "
                f"{need:,} needed ({copies} checkpoints of {need // copies:,} bytes); "
                + (f"the last complete checkpoint (step {kept[-1]}) is kept; " if kept else "")
                + "free space there (or set --run_dir elsewhere), then --resume")

    def _seal(self) -> None:
        """Orbax's thread (process 0), every file of the step written, before the rename."""
        if jax.process_index() != 0 or self._sealing is None:
            return
        step, self._sealing = self._sealing, None
        tmp = sorted(self.directory.glob(f"{step}.orbax-checkpoint-tmp*"))
        integrity.seal(tmp[-1] if tmp else self.directory / str(step))

    def save(self, state: TrainState, *, step: int | None = None) -> bool:
        return self.maybe_save(state, step=step, force=True)

    def latest_step(self) -> int | None:
        return self._manager.latest_step()

    def all_steps(self) -> list[int]:
        return sorted(self._manager.all_steps())

    def restore(self, abstract_state: TrainState, step: int | None = None) -> TrainState:
        """Restore `step` (default latest) into the shardings of `abstract_state`
        (`jaxrl.train.state.train_state_shardings(...)[0]`), and hand the registered extras
        their saved values."""
        self.wait()
        step = self.latest_step() if step is None else step
        if step is None:
            raise FileNotFoundError(f"no checkpoint in {self.directory}")
        args = ocp.args.Composite(
            state=ocp.args.StandardRestore(abstract_state), extra=ocp.args.JsonRestore()
        )
        out = self._manager.restore(step, args=args)
        extra = out["extra"] or {}
        for name, (_, setter) in self._extras.items():
            if name not in extra and name not in self._missing:
                raise KeyError(f"checkpoint step {step} has no extra {name!r}; has {sorted(extra)}")
            setter(extra.get(name, self._missing.get(name)))
        return out["state"]

    def restore_newest(self, abstract_state: TrainState) -> tuple[int, TrainState]:
        """(step, state) of the newest checkpoint that is complete and loads; newer ones that
        do not are reported and moved aside (so this run can save those steps again)."""
        self.wait()
        skipped: list[tuple[int, str]] = []
        for step in reversed(self.all_steps()):
            reason = integrity.problem(self.directory / str(step),
                                       [n for n in self._extras if n not in self._missing])
            if reason is None:
                try:
                    state = self.restore(abstract_state, step=step)
                except Exception as e:  # noqa: BLE001 - any failure to load disqualifies it
                    reason = f"it does not load: {type(e).__name__}: {str(e).splitlines()[0][:300]}"
                else:
                    self._set_aside(skipped)
                    return step, state
            log.warning("checkpoint step %d skipped: %s", step, reason)
            skipped.append((step, reason))
        found = "; ".join(f"step {s}: {r}" for s, r in skipped) or "none found"
        raise NoUsableCheckpoint(
            f"no usable checkpoint in {self.directory} ({found}); nothing was changed: restore "
            f"the files, or start a new run (another --name, or move the run directory aside)",
            skipped)

    def _set_aside(self, skipped: list[tuple[int, str]]) -> None:
        if not skipped:
            return
        if jax.process_index() == 0:
            aside = self.directory.parent / "damaged_checkpoints"
            aside.mkdir(exist_ok=True)
            stamp = time.strftime("%Y%m%d-%H%M%S")
            for step, reason in skipped:
                target = aside / f"{step}-{stamp}"
                (self.directory / str(step)).rename(target)
                (target / "why.txt").write_text(reason + "\n")
                log.warning("moved the damaged checkpoint step %d to %s", step, target)
        if jax.process_count() > 1:
            from jax.experimental import multihost_utils

            multihost_utils.sync_global_devices("jaxrl: damaged checkpoints moved aside")
        self._manager.reload()

    def wait(self) -> None:
        with self._one_line_if_disk_full():
            self._manager.wait_until_finished()

    def close(self) -> None:
        try:
            self.wait()
        finally:
            self._manager.close()


@contextlib.contextmanager
def naming_config_differences(recorded, run_dir: Path):
    """Inside: no checkpoint of `run_dir` loading into the run built from `recorded` (the config
    as config.json records it) raises an error naming the keys that differ from the run's saved
    config, when some decide what a checkpoint holds (`jaxrl.config.resume.restore_error`)."""
    try:
        yield
    except NoUsableCheckpoint as e:
        raise restore_error(recorded, run_dir, e) from None


def export_hf(graphdef, params: dict, model_cfg, path: str | Path) -> None:
    """Write the policy `params` as a Hugging Face model directory (safetensors + config)."""
    from flax import nnx

    from jaxrl.models.hf import save_pretrained

    model = nnx.merge(graphdef, jax.device_get(params))
    save_pretrained(model, model_cfg, str(path))
