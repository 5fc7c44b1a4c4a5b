"""The one error type of jaxrl's configuration and the checks every section uses (no JAX)."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any, Literal

DTypeName = Literal["float32", "bfloat16", "float16"]


class ConfigError(ValueError):
    """A config value, key or file is invalid; the message says which and what is allowed."""


class ConfigWarning(UserWarning):
    """A valid config value that almost surely does not do what was meant; the message names
    the key and what happens."""


def check_choice(owner: str, name: str, value: Any, choices: tuple) -> None:
    if value not in choices:
        raise ConfigError(
            f"{owner}.{name}: invalid value {value!r}; valid choices: {list(choices)}"
        )


def check_positive(owner: str, **values: Any) -> None:
    for name, value in values.items():
        if value is not None and value <= 0:
            raise ConfigError(f"{owner}.{name}: must be > 0, got {value!r}")


def literal_choices(tp: Any) -> tuple | None:
    if typing.get_origin(tp) is Literal:
        return typing.get_args(tp)
    return None


def validate_literals(obj: Any) -> None:
    """Check every `Literal[...]` field of a dataclass instance against its choices."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        choices = literal_choices(hints[f.name])
        if choices is not None:
            check_choice(type(obj).__name__, f.name, getattr(obj, f.name), choices)




def check(owner: str, name: str, ok: bool, value: Any, need: str) -> None:
    """Raise ConfigError `owner.name=value is not valid; it must be <need>` unless `ok`."""
    if not ok:
        raise ConfigError(f"{owner}.{name}={value!r} is not valid; it must be {need}")
