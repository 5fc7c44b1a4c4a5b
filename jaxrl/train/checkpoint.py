"""Checkpoints (orbax): the whole `TrainState` plus opaque JSON state other parts register.

    ckpt = Checkpointer(run_dir / "checkpoints", every=100, keep=3)
    ckpt.register("data", get=lambda: it.get_state(), set=it.set_state)   # any JSON-able state
    ckpt.maybe_save(trainer.state, step=s)  # every `every` steps, asynchronous
    state = ckpt.restore(abstract_state)    # latest; shardings taken from `abstract_state`

Saving is asynchronous: the arrays are copied off the devices, then written in the background
while training continues (`wait()` blocks until written). Restore reads each array straight into
the sharding of the given abstract state, so a checkpoint written from one trainer-mesh shape
restores onto another. `export_hf` writes the policy as a Hugging Face directory.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import jax
import orbax.checkpoint as ocp

from jaxrl.train.state import TrainState


class Checkpointer:
    def __init__(self, directory: str | Path, *, every: int, keep: int, use_async: bool = True):
        if every < 0 or keep < 1:
            raise ValueError(f"checkpoint every must be >= 0 and keep >= 1; got {every}, {keep}")
        self.directory = Path(directory).absolute()
        self.every = every
        options = ocp.CheckpointManagerOptions(
            max_to_keep=keep,
            save_interval_steps=max(every, 1),
            enable_async_checkpointing=use_async,
            create=True,
        )
        self._manager = ocp.CheckpointManager(self.directory, options=options)
        self._extras: dict[str, tuple[Callable[[], Any], Callable[[Any], None]]] = {}

    def register(self, name: str, *, get: Callable[[], Any], set: Callable[[Any], None]) -> None:
        """Save `get()` (JSON-able) with every checkpoint; `set(value)` it back on restore."""
        if name in self._extras:
            raise ValueError(f"checkpoint extra {name!r} registered twice")
        self._extras[name] = (get, set)

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
        return self._manager.save(step, args=self._save_args(state), force=True)

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
            if name not in extra:
                raise KeyError(f"checkpoint step {step} has no extra {name!r}; has {sorted(extra)}")
            setter(extra[name])
        return out["state"]

    def wait(self) -> None:
        self._manager.wait_until_finished()

    def close(self) -> None:
        self._manager.wait_until_finished()
        self._manager.close()


def export_hf(graphdef, params: dict, model_cfg, path: str | Path) -> None:
    """Write the policy `params` as a Hugging Face model directory (safetensors + config)."""
    from flax import nnx

    from jaxrl.models.hf import save_pretrained

    model = nnx.merge(graphdef, jax.device_get(params))
    save_pretrained(model, model_cfg, str(path))
