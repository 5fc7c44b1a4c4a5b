"""A `RunConfig` read back from a run directory's config.json, and what differs between two
configs (no JAX).

    cfg = read_config(run_dir / "config.json")                  # export / generate: any task
    cfg = read_config(run_dir / "config.json", any_task=False)  # resume: the task must exist
    differences(to_dict(saved), to_dict(cfg))   # ["model.hidden_size: 64 -> 32", ...]

A run of `jaxrl.api.train` or of an experiment file that registers its own task records a task
name that only that process registered; exporting or sampling its policy needs the weights and
the model config, never the task, so `any_task=True` keeps the name as it is (whatever needs
the task itself then fails naming it).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import typing
from pathlib import Path
from typing import Any

from jaxrl.config.base import ConfigError
from jaxrl.config.data import tasks_unchecked
from jaxrl.config.run import RunConfig

log = logging.getLogger("jaxrl")


def from_dict(cls: type, raw: dict, where: str = "") -> Any:
    """`cls` built from `raw` (as `to_dict` wrote it): nested sections rebuilt, lists made
    tuples; a key this jaxrl does not know is ignored with a warning naming it, a missing one
    takes its default (a run written before the field existed)."""
    hints = typing.get_type_hints(cls)
    kw = {}
    for f in dataclasses.fields(cls):
        if f.name not in raw:
            continue
        value, tp = raw[f.name], hints[f.name]
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        sub = tp if dataclasses.is_dataclass(tp) else next(
            (a for a in args if dataclasses.is_dataclass(a)), None)
        if sub is not None and isinstance(value, dict):
            value = from_dict(sub, value, f"{where}{f.name}.")
        elif isinstance(value, list):
            value = tuple(tuple(v) if isinstance(v, list) else v for v in value)
        kw[f.name] = value
    unknown = sorted(set(raw) - {f.name for f in dataclasses.fields(cls)})
    if unknown:
        log.warning("run config: ignoring keys this jaxrl does not know: %s",
                    [where + k for k in unknown])
    return cls(**kw)


def read_config(path: str | Path, *, any_task: bool = True) -> RunConfig:
    """The `RunConfig` recorded in `path` (a run directory's config.json). `any_task`: keep a
    `data.task` this process has not registered (see the module docstring)."""
    path = Path(path)
    try:
        raw = json.loads(path.read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read: {e}") from None
    try:
        if any_task:
            with tasks_unchecked():
                return from_dict(RunConfig, raw)
        return from_dict(RunConfig, raw)
    except ConfigError as e:
        raise ConfigError(f"{path}: {e}") from None
    except (TypeError, ValueError) as e:
        raise ConfigError(f"{path} cannot be read back as a run config: {e}") from None


def differences(saved: dict, current: dict, prefix: str = "") -> list[str]:
    """The dotted keys whose values differ between two `to_dict` configs, as
    `key: saved -> current` (a section present in one only counts as its keys)."""
    out = []
    for key in sorted(set(saved) | set(current), key=str):
        a, b = saved.get(key), current.get(key)
        if isinstance(a, dict) or isinstance(b, dict):
            out += differences(a if isinstance(a, dict) else {}, b if isinstance(b, dict) else {},
                               f"{prefix}{key}.")
        elif _norm(a) != _norm(b):
            out.append(f"{prefix}{key}: {a!r} -> {b!r}")
    return out


def _norm(value: Any) -> Any:
    """JSON's view of a value: tuples and lists compare equal."""
    if isinstance(value, (list, tuple)):
        return [_norm(v) for v in value]
    return value
