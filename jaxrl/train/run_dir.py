"""A run directory read without JAX (`launch/export.py` answers a bad one before importing it):
is it one, its checkpoint steps, the `RunConfig` its config.json recorded (`jaxrl.config.to_dict`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from jaxrl.config import ConfigError, RunConfig
from jaxrl.config.readback import read_config


def is_run_dir(path: str | Path) -> bool:
    """A jaxrl run directory (its config.json is a RunConfig), not a Hugging Face model."""
    cfg_file = Path(path) / "config.json"
    if not cfg_file.is_file():
        return False
    try:
        raw = json.loads(cfg_file.read_text())
    except ValueError:
        return False
    return isinstance(raw, dict) and {"pipeline", "train", "data", "model"} <= raw.keys()


def check_writable(run_root: str | Path) -> None:
    """`--run_dir` can hold run directories: the nearest part of it that exists is a directory
    this process may create entries in; a `ConfigError` naming the problem otherwise."""
    path = Path(run_root).absolute()
    while not path.exists() and path != path.parent:
        path = path.parent
    if not path.is_dir():
        raise ConfigError(f"run_dir={str(run_root)!r}: {path} is a file, not a directory; choose "
                          "another --run_dir")
    if not os.access(path, os.W_OK | os.X_OK):
        raise ConfigError(f"run_dir={str(run_root)!r}: cannot create run directories in {path} "
                          "(no write permission, or a read-only file system); choose another "
                          "--run_dir")


def checkpoint_steps(run_dir: str | Path) -> list[int]:
    ckpt = Path(run_dir) / "checkpoints"
    if not ckpt.is_dir():
        return []
    return sorted(int(p.name) for p in ckpt.iterdir() if p.name.isdigit() and p.is_dir())


def check_run_dir(run_dir: str | Path, step: int | None = None) -> int:
    """The checkpoint step to read (`step`, or the latest); a `ConfigError` naming the problem
    otherwise. Reads only the file system (no JAX)."""
    run_dir = Path(run_dir)
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such run directory (expected runs/<name>)")
    if not is_run_dir(run_dir):
        raise ConfigError(f"{run_dir}: not a jaxrl run directory (its config.json is missing or "
                          "is not a jaxrl run config)")
    steps = checkpoint_steps(run_dir)
    if not steps:
        raise ConfigError(f"{run_dir}: the run has no checkpoint under checkpoints/ yet")
    if step is None:
        return steps[-1]
    if step not in steps:
        raise ConfigError(f"--step {step}: {run_dir} has checkpoints at steps {steps}")
    return step


def run_config(run_dir: str | Path, *, any_task: bool = True) -> RunConfig:
    """The `RunConfig` a run directory recorded in its config.json. `any_task` (export,
    sampling): a `data.task` registered only in the process that ran it (`jaxrl.api.train`, an
    experiment file's `register_task`) is kept as a name, not refused."""
    return read_config(Path(run_dir) / "config.json", any_task=any_task)
