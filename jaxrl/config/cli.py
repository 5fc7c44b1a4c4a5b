"""The command line of `launch/run.py`: its flags, `--help` built from the config dataclasses, and
`--print-config`. No JAX imports: a wrong flag or value fails before JAX starts.

The key descriptions come from the dataclasses' own source: the comment after a field
(`steps: int = 40  # RL updates in the run`) or the comment lines right above it, or else a
`name   description` table in the class docstring, so they are written once, next to the
fields. The class docstring's first line describes a section.
"""

from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import io
import json
import re
import textwrap
import tokenize
import typing
from typing import Any

from jaxrl.config.base import ConfigError, literal_choices
from jaxrl.config.overrides import _strip_optional, to_dict

FLAGS = {
    "--config": "experiment file, or a shipped config by name (arith); default configs/default.py",
    "--resume": "continue run --name from its latest checkpoint, with its saved config.json "
                "(flags given now apply on top)",
    "--quiet": "no progress display",
    "--print-config": "print the resolved config (after overrides) as JSON and exit",
    "--help": "this text: the flags, then every config key with its value and description",
}


@dataclasses.dataclass
class Args:
    config: str | None = None
    resume: bool = False
    quiet: bool = False
    print_config: bool = False
    help: bool = False
    overrides: list[str] = dataclasses.field(default_factory=list)


def parse_args(argv: list[str]) -> Args:
    """Split the launcher's own flags from config overrides (`--key=value` / `--key value`).

    Overrides are checked later against the config (`apply_overrides`); a flag that takes no
    value given one, or `--config` without a path, fails here."""
    args = Args()
    i = 0
    while i < len(argv):
        item = argv[i]
        name, eq, value = item.partition("=")
        if name in ("-h", "--help", "--resume", "--quiet", "--print-config"):
            if eq:
                raise ConfigError(f"{name} takes no value, got {item!r}")
            attr = "help" if name == "-h" else name[2:].replace("-", "_")
            setattr(args, attr, True)
        elif name == "--config":
            if not eq:
                if i + 1 >= len(argv) or argv[i + 1].startswith("--"):
                    raise ConfigError("--config needs a path, e.g. --config configs/arith.py")
                i += 1
                value = argv[i]
            args.config = value
        else:
            args.overrides.append(item)
        i += 1
    return args


# ------------------------------------------------------------------------- descriptions


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based, within `source`) -> the text of the comment on that line."""
    out = {}
    for tok in tokenize.generate_tokens(io.StringIO(source).readline):
        if tok.type == tokenize.COMMENT:
            out[tok.start[0]] = tok.string.lstrip("#").strip()
    return out


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """{field name: description} from the comments in `cls`'s source (empty if it has none)."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return {}
    comments = _comments(source)
    lines = source.splitlines()
    tree = ast.parse(source)
    docs, headings = {}, set()
    for node in tree.body[0].body:
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        text = comments.get(node.end_lineno, "")
        if text:  # a trailing comment, continued on lines that start with "#  "
            n = node.end_lineno + 1
            while n <= len(lines) and _continues(lines[n - 1]):
                text += " " + comments.get(n, "")
                n += 1
        else:  # the comment lines directly above the field
            above, n = [], node.lineno - 1
            while n >= 1 and lines[n - 1].strip().startswith("#") and not _continues(
                    lines[n - 1]):
                above.insert(0, comments.get(n, ""))
                n -= 1
            text = " ".join(above)
            if len(above) == 1:  # a one-line heading over a group of fields
                headings.add(node.target.id)
        docs[node.target.id] = text.removeprefix("--- ").strip()
    for name, text in _docstring_table(inspect.getdoc(cls) or "").items():
        if not docs.get(name) or name in headings:  # described in the class docstring
            docs[name] = text
    return docs


_TABLE_ROW = re.compile(r"^(\s+)([A-Za-z_]\w*(?:\s*/\s*[A-Za-z_]\w*)*)\s{2,}(\S.*)$")


def _docstring_table(doc: str) -> dict[str, str]:
    """Rows of a docstring's `name [/ name]   description` table (continued on lines indented
    to the description's column), as {name: description}."""
    out, lines, i = {}, doc.splitlines(), 0
    while i < len(lines):
        m = _TABLE_ROW.match(lines[i])
        i += 1
        if not m:
            continue
        col, text = m.start(3), [m.group(3)]
        while i < len(lines) and lines[i].strip() and (
                len(lines[i]) - len(lines[i].lstrip())) >= col:
            text.append(lines[i].strip())
            i += 1
        for name in m.group(2).split("/"):
            out[name.strip()] = " ".join(text)
    return out


def _continues(line: str) -> bool:
    """A comment line that continues the trailing comment of the field above it."""
    return line.strip().startswith("#  ")


def _type_name(tp: Any) -> str:
    inner, optional = _strip_optional(tp)
    choices = literal_choices(inner)
    if choices is not None:
        name = "{" + ",".join(str(c) for c in choices) + "}"
    elif typing.get_origin(inner) is tuple:
        name = "ints (e.g. 4x1)" if typing.get_args(inner)[:1] == (int,) else "list"
    else:
        name = getattr(inner, "__name__", str(inner))
    return name + (" | none" if optional else "")


def _show(value: Any) -> str:
    if isinstance(value, tuple):
        return "x".join(str(v) for v in value) if value else "()"
    if value is None:
        return "none"
    if isinstance(value, bool):
        return str(value).lower()
    return str(value)


def _section_doc(cls: type) -> str:
    doc = inspect.getdoc(cls) or ""
    return doc.split("\n\n")[0].replace("\n", " ")


def _keys(cfg: Any, cls: type, prefix: str) -> tuple[list, list]:
    """(this section's key rows, its subsections as (name, value, class))."""
    hints = typing.get_type_hints(cls)
    docs = field_docs(cls)
    rows, subs = [], []
    for f in dataclasses.fields(cls):
        tp = hints[f.name]
        inner, _ = _strip_optional(tp)
        value = getattr(cfg, f.name)
        if dataclasses.is_dataclass(inner):
            subs.append((prefix + f.name, value, inner))
        else:
            rows.append((prefix + f.name, _show(value), _type_name(tp), docs.get(f.name, "")))
    return rows, subs


def _format_rows(rows: list, width: int = 100) -> list[str]:
    out = []
    for key, value, tp, doc in rows:
        head = f"  --{key}={value}"
        text = f"[{tp}] {doc}".strip()
        if len(head) < 38:
            first = head.ljust(40)
        else:
            out.append(head)
            first = " " * 40
        wrapped = textwrap.wrap(text, width - 40) or [""]
        out.append(first + wrapped[0])
        out += [" " * 40 + line for line in wrapped[1:]]
    return out


def help_text(cfg: Any, config_path: str) -> str:
    """`--help`: the flags, then every config key grouped by section, with the value the
    experiment file gives it (the default here) and the description from its source."""
    out = ["usage: python launch/run.py [--config FILE] [--KEY=VALUE | --KEY VALUE ...] "
           "[--resume] [--quiet] [--print-config]", "",
           "Run an experiment: GRPO-family RL of a language model on verifiable tasks.", "",
           "flags:"]
    out += [f"  {flag:<22}{text}" for flag, text in FLAGS.items()]
    out += ["", f"config keys (values shown are those of {config_path}; set any with "
                "--key=value or --key value; a bare --key sets a boolean to true):"]
    pending = [("", cfg, type(cfg))]
    while pending:
        name, value, cls = pending.pop(0)
        rows, subs = _keys(cls() if value is None else value, cls, name + "." if name else "")
        title = name or "run"
        doc = _section_doc(cls)
        out += ["", f"{title}: {doc}" if doc else f"{title}:"]
        if value is None and name:
            out.append(f"  (off by default; setting any --{name}.<key> creates it with the "
                       "values below)")
        out += _format_rows(rows)
        pending[0:0] = subs  # depth first: a section's subsections follow it
    return "\n".join(out)


def config_json(cfg: Any) -> str:
    """`--print-config`: the resolved config, as the run directory's config.json holds it."""
    return json.dumps(to_dict(cfg), indent=2, default=str)
