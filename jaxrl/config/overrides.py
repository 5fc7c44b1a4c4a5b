"""Experiment files and strict `--a.b=c` / `--a.b c` overrides (unknown key, wrong type or bad
enum: an error naming the key, the valid choices and the value received). No JAX imports."""

from __future__ import annotations

import dataclasses
import importlib.util
import types
import typing
from pathlib import Path
from typing import Any

from jaxrl.config.base import ConfigError, literal_choices
from jaxrl.config.checks import deferred

# ----------------------------------------------------------------------------- overrides


def _strip_optional(tp: Any) -> tuple[Any, bool]:
    origin = typing.get_origin(tp)
    if origin in (typing.Union, types.UnionType):
        args = [a for a in typing.get_args(tp) if a is not type(None)]
        if len(args) < len(typing.get_args(tp)) and len(args) == 1:
            return args[0], True
    return tp, False


_TRUE = {"true", "1", "yes", "on"}
_FALSE = {"false", "0", "no", "off"}


def parse_value(key: str, text: str, tp: Any) -> Any:
    """Parse `text` as a value of type `tp` for `key`, or raise ConfigError."""
    inner, optional = _strip_optional(tp)
    if optional and text.strip().lower() in ("none", "null"):
        return None
    choices = literal_choices(inner)
    if choices is not None:
        if text not in [str(c) for c in choices]:
            raise ConfigError(f"--{key}: invalid value {text!r}; valid choices: {list(choices)}")
        return next(c for c in choices if str(c) == text)
    if inner is bool:
        low = text.strip().lower()
        if low in _TRUE:
            return True
        if low in _FALSE:
            return False
        raise ConfigError(f"--{key}: expected a boolean (true/false), got {text!r}")
    if inner in (int, float, str):
        if inner is str:
            return text
        try:
            return inner(text)
        except ValueError:
            raise ConfigError(f"--{key}: expected {inner.__name__}, got {text!r}") from None
    if typing.get_origin(inner) is tuple:
        args = typing.get_args(inner)
        elem = args[0] if args else str
        parts = [p for p in text.replace("x", ",").strip("()[] ").split(",") if p.strip()]
        if elem is str:
            parts = [p for p in text.strip("()[] ").split(",") if p.strip()]
        return tuple(parse_value(key, p.strip(), elem) for p in parts)
    if dataclasses.is_dataclass(inner):
        raise ConfigError(f"--{key}: is a section; set its fields, e.g. --{key}.<field>=...")
    raise ConfigError(f"--{key}: cannot parse values of type {inner!r}")


def _field_map(obj: Any) -> dict[str, tuple[dataclasses.Field, Any]]:
    hints = typing.get_type_hints(type(obj))
    return {f.name: (f, hints[f.name]) for f in dataclasses.fields(obj)}


def apply_override(cfg: Any, key: str, text: str, _prefix: str = "") -> Any:
    """Return a copy of `cfg` with the dotted `key` set from `text`."""
    head, _, rest = key.partition(".")
    full = _prefix + head
    fields = _field_map(cfg)
    if head not in fields:
        raise ConfigError(
            f"--{_prefix}{key}: unknown key {head!r} in {type(cfg).__name__}; "
            f"valid keys: {sorted(fields)}"
        )
    _, tp = fields[head]
    current = getattr(cfg, head)
    if rest:
        inner, _ = _strip_optional(tp)
        if not dataclasses.is_dataclass(inner):
            raise ConfigError(f"--{_prefix}{key}: {full!r} is a value, not a section")
        if current is None:
            current = inner()
        new = apply_override(current, rest, text, _prefix=full + ".")
    else:
        new = parse_value(full, text, tp)
    try:
        return dataclasses.replace(cfg, **{head: new})
    except ConfigError:
        raise
    except (TypeError, ValueError) as e:
        raise ConfigError(f"--{_prefix}{key}={text}: {e}") from None


def _key_type(cfg: Any, key: str) -> Any:
    """The annotated type of the dotted `key` in `cfg` (None when it is not a known value)."""
    cls = type(cfg)
    *heads, last = key.split(".")
    for head in heads:
        hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
        cls, _ = _strip_optional(hints.get(head))
    hints = typing.get_type_hints(cls) if dataclasses.is_dataclass(cls) else {}
    return hints.get(last)


def split_overrides(cfg: Any, items: list[str]) -> list[tuple[str, str]]:
    """`--a.b=c`, `a.b=c` or `--a.b c` items -> [(key, text)]; a bare `--flag` sets a boolean key
    to true. Anything else fails naming the item."""
    pairs, i = [], 0
    while i < len(items):
        item = items[i]
        if not item.startswith("--") and "=" not in item:
            raise ConfigError(f"unexpected argument {item!r}; overrides look like --key=value "
                              "or --key value")
        body = item[2:] if item.startswith("--") else item
        if "=" in body:
            key, text = body.split("=", 1)
        elif i + 1 < len(items) and not items[i + 1].startswith("--"):
            key, text = body, items[i + 1]
            i += 1
        elif _strip_optional(_key_type(cfg, body))[0] is bool:
            key, text = body, "true"
        else:
            tp = _key_type(cfg, body)
            if tp is None or dataclasses.is_dataclass(_strip_optional(tp)[0]):
                apply_override(cfg, body, "")  # an unknown key or a section: its own error
            raise ConfigError(f"override {item!r} needs a value: --{body}=VALUE or --{body} VALUE "
                              "(overrides look like --key.sub=value or --key.sub value)")
        pairs.append((key.strip(), text))
        i += 1
    return pairs


def apply_overrides(cfg: Any, overrides: list[str]) -> Any:
    """Apply `--a.b=c` / `--a.b c` (or `a.b=c`) overrides in order; checks that span sections
    run once all are applied (so their order does not matter)."""
    with deferred():
        for key, text in split_overrides(cfg, list(overrides)):
            cfg = apply_override(cfg, key, text)
    validate = getattr(cfg, "validate", None)
    return validate() if callable(validate) else cfg


SHIPPED = Path(__file__).resolve().parents[2] / "configs"


def resolve_config_path(path: str | Path) -> Path:
    """The experiment file `path` names: the path itself, else a shipped config of that name
    (`arith`, `arith.py` or `configs/arith.py` from any directory of a checkout)."""
    path = Path(path)
    if path.is_file():
        return path
    if not path.is_absolute():
        candidate = SHIPPED / path.with_suffix(".py").name
        if candidate.is_file() and path.parent in (Path("."), Path("configs")):
            return candidate
    shipped = sorted(p.stem for p in SHIPPED.glob("*.py"))
    raise ConfigError(
        f"config file {str(path)!r} not found; shipped configs (by name or path): {shipped}"
        + (f" in {SHIPPED}" if shipped else ""))


def load_config(path: str | Path, overrides: list[str] | None = None) -> Any:
    """Load `config()` from an experiment file and apply overrides."""
    path = resolve_config_path(path)
    spec = importlib.util.spec_from_file_location(f"_jaxrl_config_{path.stem}", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    if not callable(getattr(module, "config", None)):
        raise ConfigError(f"{path}: must define a function `config()` returning a RunConfig")
    cfg = module.config()
    if not dataclasses.is_dataclass(cfg):
        raise ConfigError(f"{path}: config() returned {type(cfg).__name__}, not a config dataclass")
    return apply_overrides(cfg, overrides or [])


def to_dict(cfg: Any) -> dict:
    """A JSON-friendly dict of a config (for run directories and cache keys)."""
    return dataclasses.asdict(cfg)
