"""A run directory read without JAX (`launch/export.py` answers a bad one before importing it):
is it one, its checkpoint steps, the `RunConfig` its config.json recorded (`jaxrl.config.to_dict`).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from pathlib import Path

from jaxrl.config import ConfigError, RunConfig

log = logging.getLogger("jaxrl")


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


def _from_dict(cls, raw: dict, where: str):
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue  # a run written before the field existed: its default
        value, tp = raw[f.name], hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        sub = tp if dataclasses.is_dataclass(tp) else next(
            (a for a in args if dataclasses.is_dataclass(a)), None)
        if sub is not None and isinstance(value, dict):
            value = _from_dict(sub, value, f"{where}{f.name}.")
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kw[f.name] = value
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        log.warning("run config: ignoring keys this jaxrl does not know: %s",
                    [where + k for k in unknown])
    return cls(**kw)


def run_config(run_dir: str | Path) -> RunConfig:
    """The `RunConfig` a run directory recorded in its config.json."""
    raw = json.loads((Path(run_dir) / "config.json").read_text())
    try:
        return _from_dict(RunConfig, raw, "")
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{run_dir}/config.json cannot be read back as a run config: {e}") from e
