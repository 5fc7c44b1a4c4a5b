"""The versioned JSON schemas of benchmark results: `bench.py suite` documents
(docs/benchmark_schema.md) and the result files behind docs/benchmarks.md.

A result file (`results/<benchmark>.<machine>.json`, `"kind": "results"`) holds the current
figures of one benchmark on one machine, one record each, transcribed from a run or written by
hand after one: what was measured, its value and unit, the peer and the paired ratio (with the
per-round ratios where recorded), the target and whether it is met, the exact command, threads,
load average, date, the commit that recorded the figure (and the code measured where it
differs), and a one-line `correction` when an earlier figure did not hold. `launch/report.py
--page` renders the page from these files and the suite documents.

Bump `SCHEMA_VERSION` (suite) or `RESULTS_VERSION` on any change a reader of an older document
would misread (a renamed or re-defined field); adding an optional field keeps the version.
`validate(doc)` checks either kind with `jsonschema` (the `test` and `bench` extras) and raises
`SchemaError` naming the first bad field.
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


RESULTS_VERSION = 1
# met / not_met: against the row's target; unreachable: shown out of reach on that machine;
# pending: not measured yet (the command says how); measured: a figure without a target;
# failed: the run did not finish (the note says why)
RESULT_STATUSES = ("met", "not_met", "unreachable", "pending", "measured", "failed")

_LINE = {"type": "string", "minLength": 1, "pattern": "^[^\\n]*$"}  # one line of text
_NUMS = {"type": "array", "items": {"type": "number"}, "minItems": 1}
_RECORD = {
    "type": "object",
    "required": ["name", "value", "status", "load", "date", "commit"],
    "anyOf": [{"required": ["command"]}, {"required": ["method"]}],
    "additionalProperties": False,
    "properties": {
        "name": _LINE,                      # what was measured, on what workload
        "headline": _LINE,                  # set: a row of the page's summary, labelled so
        "value": _NUM,                      # null: pending, failed, or the ratio is the figure
        "unit": _LINE,
        "before": {"type": "number"},       # a before -> after figure (pass@1 before RL)
        "runs": _NUMS,                      # each run's value where no single one is quoted
        "peer": {"type": "object", "required": ["name", "value"], "additionalProperties": False,
                 "properties": {"name": _LINE, "value": _NUM, "unit": _LINE, "runs": _NUMS}},
        "ratio": {"type": "number"},
        "ratio_rounds": _NUMS,              # the paired per-round ratios the ratio is the median of
        "ratio_of": _LINE,                  # what is divided by what ("jaxrl / peer step")
        "target": _LINE,
        "status": {"enum": list(RESULT_STATUSES)},
        "command": _LINE,                   # the exact shell command
        "method": _LINE,                    # how it was measured, where no command says it all
        "threads": _LINE,
        "load": {"oneOf": [{"type": "null"}, _LINE]},  # load average as recorded
        "date": {"type": "string", "pattern": "^[0-9]{4}-[0-9]{2}-[0-9]{2}$"},
        "time": _LINE,                      # UTC, as recorded
        "commit": {"type": "string", "pattern": "^[0-9a-f]{7,40}$"},  # that recorded the figure
        "code": {"type": "string", "pattern": "^[0-9a-f]{7,40}$"},    # the code measured
        "correction": _LINE,
        "note": _LINE,
    },
    "dependentRequired": {"ratio": ["ratio_of"], "ratio_rounds": ["ratio"], "before": ["value"]},
    # a figure met, missed or out of reach says against what
    "if": {"properties": {"status": {"enum": ["met", "not_met", "unreachable"]}}},
    "then": {"required": ["target"]},
}

RESULTS_SCHEMA = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "title": "jaxrl benchmark result file (one benchmark, one machine)",
    "type": "object",
    "required": ["schema_version", "kind", "benchmark", "area", "machine", "records"],
    "additionalProperties": False,
    "properties": {
        "schema_version": {"const": RESULTS_VERSION},
        "kind": {"const": "results"},
        "benchmark": {"type": "string", "pattern": "^[a-z0-9][a-z0-9-]*$"},
        "area": _LINE,                      # the page section it is listed under
        "about": _LINE,                     # the workload, once for all records
        "machine": {"type": "object", "required": ["name", "description"],
                    "additionalProperties": False,
                    "properties": {"name": {"type": "string", "pattern": "^[a-z0-9][a-z0-9-]*$"},
                                   "description": _LINE}},
        "records": {"type": "array", "items": _RECORD, "minItems": 1},
    },
}


class SchemaError(ValueError):
    """A document that does not match its schema (`SCHEMA` or `RESULTS_SCHEMA`)."""


def validate(doc: dict) -> None:
    """Raise `SchemaError` (naming the field's path) unless `doc` matches its schema:
    `RESULTS_SCHEMA` for a result file (`"kind": "results"`), else the suite's `SCHEMA`."""
    schema = RESULTS_SCHEMA if isinstance(doc, dict) and doc.get("kind") == "results" else SCHEMA
    try:
        import jsonschema
    except ImportError:
        raise ImportError("validating a suite document needs jsonschema: pip install "
                          "'jaxrl[bench]' (or pip install jsonschema)") from None
    errors = sorted(jsonschema.Draft202012Validator(schema).iter_errors(doc),
                    key=lambda e: list(e.absolute_path))
    if errors:
        e = errors[0]
        where = "/".join(str(p) for p in e.absolute_path) or "(document)"
        raise SchemaError(f"{where}: {e.message} ({len(errors)} error(s) in all)")
