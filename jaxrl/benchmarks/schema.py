"""The versioned JSON schema of `bench.py suite` documents (docs/benchmark_schema.md).

Bump `SCHEMA_VERSION` on any change a reader of an older document would misread (a renamed or
re-defined field); adding an optional field keeps the version. `validate(doc)` checks a document
with `jsonschema` (the `test` and `bench` extras) and raises `SchemaError` naming the first bad
field.
"""

from __future__ import annotations

SCHEMA_VERSION = 1
SIZES = ("smoke", "small", "full")
# every suite document has one entry per name, "skipped" with a reason where it did not run
BENCHMARK_NAMES = ("generate", "train", "reshard", "sandbox", "pipeline", "kernels", "rl_step")
STATUSES = ("ok", "skipped", "failed")

_NUM = {"type": ["number", "null"]}
_STR = {"type": ["string", "null"]}
# figures are flat: name -> number, string, boolean or null (nested results joined with "/")
_FIGURES = {"type": "object",
            "additionalProperties": {"type": ["number", "string", "boolean", "null"]}}

_MACHINE = {
    "type": "object",
    "required": ["name", "backend", "device_kind", "device_count", "chips", "device_memory_bytes",
                 "host_cpu", "host_cores", "load_average", "jax", "jaxlib", "flax",
                 "jaxrl_commit"],
    "properties": {
        "name": {"type": "string", "minLength": 1},
        "backend": {"type": "string"},
        "device_kind": {"type": "string"},
        "device_count": {"type": "integer", "minimum": 1},
        "chips": {"type": "integer", "minimum": 1},
        "device_memory_bytes": {"type": ["integer", "null"]},
        "host_cpu": {"type": "string"},
        "host_cores": {"type": "integer", "minimum": 1},
        "load_average": {"type": "array", "items": {"type": "number"}, "minItems": 3,
                         "maxItems": 3},
        "jax": {"type": "string"}, "jaxlib": {"type": "string"}, "flax": {"type": "string"},
        "jaxrl_commit": {"type": "string"},
    },
}

_BENCHMARK = {
    "type": "object",
    "required": ["status", "reason", "seconds", "command", "figures", "peer", "roofline"],
    "properties": {
        "status": {"enum": list(STATUSES)},
        "reason": _STR,
        "seconds": {"type": "number", "minimum": 0},
        "command": _STR,
        "figures": _FIGURES,
        "peer": {"oneOf": [{"type": "null"}, {
            "type": "object", "required": ["name", "figures"],
            "properties": {"name": {"type": "string"}, "figures": _FIGURES}}]},
        "roofline": _FIGURES,
    },
    # a skipped or failed entry says why
    "if": {"properties": {"status": {"enum": ["skipped", "failed"]}}},
    "then": {"properties": {"reason": {"type": "string", "minLength": 1}}},
}

SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "jaxrl benchmark suite result",
    "type": "object",
    "required": ["schema_version", "size", "created", "command", "machine", "roofline",
                 "workload", "benchmarks"],
    "properties": {
        "schema_version": {"const": SCHEMA_VERSION},
        "size": {"enum": list(SIZES)},
        "created": {"type": "string"},
        "command": {"type": "string"},
        "machine": _MACHINE,
        "roofline": {"type": "object",
                     "required": ["matmul_peak_flops", "memory_gbps", "method"],
                     "properties": {"matmul_peak_flops": _NUM, "memory_gbps": _NUM,
                                    "method": {"type": "string"}}},
        "workload": _FIGURES,
        "benchmarks": {"type": "object", "required": list(BENCHMARK_NAMES),
                       "additionalProperties": _BENCHMARK},
    },
}


class SchemaError(ValueError):
    """A document that does not match `SCHEMA`."""


def validate(doc: dict) -> None:
    """Raise `SchemaError` (naming the field's path) unless `doc` matches `SCHEMA`."""
    try:
        import jsonschema
    except ImportError:
        raise ImportError("validating a suite document needs jsonschema: pip install "
                          "'jaxrl[bench]' (or pip install jsonschema)") from None
    errors = sorted(jsonschema.Draft202012Validator(SCHEMA).iter_errors(doc),
                    key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(document)"
        raise SchemaError(f"{where}: {e.message} ({len(errors)} error(s) in all)")
