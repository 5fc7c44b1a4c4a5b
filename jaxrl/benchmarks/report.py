"""Benchmark reports: suite results side by side, and the results page.

`python launch/report.py A.json B.json ... [--out DIR]` reads `bench.py suite` documents (any
number of machines), checks each against the schema, prints a markdown table with one column per
document, and writes it with one PNG bar chart per headline figure (`CHARTS`) into `--out`. A
figure a document lacks (a skipped benchmark, a peer that did not run) shows as "–" in the table
and as a missing bar. Charts need matplotlib (the `bench` extra), imported only when charts are
drawn, with the Agg backend (no display).

`python launch/report.py --page` writes docs/benchmarks.md from the result files in `results/`
and the suite documents in `docs/bench_results/` (`--check`: exit 1 when the page differs);
`render_page` is the whole page, deterministic (no generation time), so a test can compare it.
"""

from __future__ import annotations

import argparse
import decimal
import json
import re
import sys
from pathlib import Path

from jaxrl.benchmarks.schema import SchemaError, validate

MISSING = "–"

# (row label, where, key, format): where is "machine", "roofline", "doc" or
# "<benchmark>.<figures|roofline|peer>"; format "pct" shows a fraction as a percentage.
ROWS = [
    ("size", "doc", "size", "str"),
    ("backend", "machine", "backend", "str"),
    ("device kind", "machine", "device_kind", "str"),
    ("devices / chips", "machine", "devices_chips", "str"),
    ("host CPU", "machine", "host_cpu", "str"),
    ("host cores", "machine", "host_cores", "int"),
    ("load average (1 min) at start", "machine", "load1", "num"),
    ("jax", "machine", "jax", "str"),
    ("matmul peak (GFLOP/s, measured)", "roofline", "matmul_peak_gflops", "num"),
    ("memory bandwidth (GB/s, measured)", "roofline", "memory_gbps", "num"),
    ("RL step time, sync (s)", "rl_step.figures", "step_s", "num"),
    ("RL rollouts/s per chip, sync", "rl_step.figures", "rollouts_per_s_per_chip", "num"),
    ("RL rollouts/s per chip, async", "pipeline.figures", "async/rollouts_per_s_per_chip", "num"),
    ("async speedup over sync", "pipeline.figures", "async/speedup_vs_sync", "x"),
    ("trainer tokens/s per chip", "train.figures", "tokens_per_s_per_chip", "num"),
    ("trainer MFU (vs measured peak)", "train.roofline", "mfu", "pct"),
    ("trainer / torch peer", "train.figures", "ratio_vs_peer", "x"),
    ("generator tokens/s per chip", "generate.figures", "tokens_per_s_per_chip", "num"),
    ("generator bandwidth fraction", "generate.roofline", "bandwidth_frac", "pct"),
    ("generator / transformers peer", "generate.figures", "ratio_vs_peer", "x"),
    ("weight sync (GB/s)", "reshard.figures", "weight_sync_gbps", "num"),
    ("weight sync / host round trip", "reshard.figures", "speedup_vs_host", "x"),
    ("sandbox executions/s per core", "sandbox.figures", "exec_per_s_per_core", "num"),
    ("sandbox warm pool / fresh python3", "sandbox.figures", "ratio_vs_fresh", "x"),
    ("kernels: prefill T=4096 (TFLOP/s)", "kernels.figures", "prefill_T4096_tflops", "num"),
    ("kernels: decode B=256 L=8192 (GB/s)", "kernels.figures", "decode_B256_L8192_gbps", "num"),
]
# (file stem, title, y label, where, key): one bar chart each
CHARTS = [
    ("rollouts_per_chip", "RL rollouts/s per chip (sync)", "rollouts/s",
     "rl_step.figures", "rollouts_per_s_per_chip"),
    ("rl_step_time", "End-to-end RL step time (sync)", "seconds", "rl_step.figures", "step_s"),
    ("trainer_mfu", "Trainer MFU (vs measured matmul peak)", "fraction", "train.roofline", "mfu"),
    ("generator_tokens_per_chip", "Generator tokens/s per chip", "tokens/s",
     "generate.figures", "tokens_per_s_per_chip"),
    ("generator_bandwidth_frac", "Generator decode: fraction of memory bandwidth", "fraction",
     "generate.roofline", "bandwidth_frac"),
    ("weight_sync_gbps", "Weight sync (trainer -> generator)", "GB/s",
     "reshard.figures", "weight_sync_gbps"),
    ("sandbox_exec_per_core", "Sandbox executions/s per core", "executions/s",
     "sandbox.figures", "exec_per_s_per_core"),
]


def _parse(argv):
    p = argparse.ArgumentParser(prog="report.py", description=__doc__.splitlines()[0])
    p.add_argument("files", nargs="*", help="suite result documents (bench.py suite --json)")
    p.add_argument("--out", default="bench_report",
                   help="directory for report.md and the PNG charts (created)")
    p.add_argument("--no-charts", action="store_true", help="the table only (no matplotlib)")
    p.add_argument("--page", action="store_true",
                   help=f"write {PAGE} from {RESULTS_DIR}/*.json and {SUITE_DIR}/*.json")
    p.add_argument("--check", action="store_true",
                   help=f"with --page: write nothing, exit 1 when {PAGE} is not what they generate")
    args = p.parse_args(argv)
    if args.page and args.files:
        p.error("--page reads the result folders; it takes no files")
    if args.check and not args.page:
        p.error("--check goes with --page")
    if not args.page and not args.files:
        p.error("give suite result documents, or --page")
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        p.error(f"no such file(s): {', '.join(missing)}")
    return args


def main(argv: list[str], root: Path | None = None) -> int:
    """`root`: the repository whose result folders `--page` reads (default: the working dir)."""
    args = _parse(argv)
    if args.page:
        return write_page(Path.cwd() if root is None else root, check=args.check)
    docs = []
    for f in args.files:
        try:
            doc = json.loads(Path(f).read_text())
            validate(doc)
        except (json.JSONDecodeError, SchemaError) as e:
            print(f"report.py: {f} is not a suite result document: {e}", file=sys.stderr)
            return 2
        docs.append(doc)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    table = markdown_table(docs)
    (out / "report.md").write_text(table + "\n")
    print(table)
    if not args.no_charts:
        for path in write_charts(docs, out):
            print(f"wrote {path}", file=sys.stderr)
    return 0


def column_names(docs: list[dict]) -> list[str]:
    """Each document's machine name, made unique ("name (2)") when two share one."""
    names, seen = [], {}
    for d in docs:
        n = d["machine"]["name"]
        seen[n] = seen.get(n, 0) + 1
        names.append(n if seen[n] == 1 else f"{n} ({seen[n]})")
    return names


def value(doc: dict, where: str, key: str):
    """The figure at (where, key) in `doc`, or None when the document lacks it."""
    m = doc["machine"]
    if where == "doc":
        return doc.get(key)
    if where == "machine":
        derived = {"devices_chips": f"{m['device_count']} / {m['chips']}",
                   "load1": m["load_average"][0]}
        return derived[key] if key in derived else m.get(key)
    if where == "roofline":
        r = doc["roofline"]
        if key == "matmul_peak_gflops":
            return None if r["matmul_peak_flops"] is None else r["matmul_peak_flops"] / 1e9
        return r.get(key)
    bench, part = where.split(".")
    entry = doc["benchmarks"].get(bench)
    if entry is None or entry["status"] != "ok":
        return None
    section = entry[part] if part != "peer" else (entry["peer"] or {}).get("figures", {})
    return section.get(key)


def fmt(v, kind: str) -> str:
    if v is None or (isinstance(v, str) and kind != "str"):
        return MISSING
    if kind == "str":
        return str(v).replace("|", "/")
    if kind == "int":
        return str(int(v))
    if kind == "pct":
        return f"{100 * v:.3g}%"
    if kind == "x":
        return f"{v:.3g}x"
    return f"{v:.3g}" if abs(v) < 1e6 else f"{v:.3e}"


def markdown_table(docs: list[dict]) -> str:
    names = column_names(docs)
    lines = ["| figure | " + " | ".join(names) + " |",
             "|---|" + "---|" * len(names)]
    for label, where, key, kind in ROWS:
        lines.append(f"| {label} | " + " | ".join(fmt(value(d, where, key), kind) for d in docs)
                     + " |")
    return "\n".join(lines)


def write_charts(docs: list[dict], out: Path) -> list[Path]:
    """One PNG bar chart per entry of `CHARTS` (machines on the x axis); returns the paths."""
    try:
        import matplotlib
    except ImportError:
        raise SystemExit("report.py: charts need matplotlib: pip install 'jaxrl[bench]' (or "
                         "pip install matplotlib), or pass --no-charts for the table only"
                         ) from None
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = column_names(docs)
    paths = []
    for stem, title, ylabel, where, key in CHARTS:
        vals = [value(d, where, key) for d in docs]
        fig, ax = plt.subplots(figsize=(6.4, 3.6), dpi=100)
        xs = range(len(names))
        heights = [v if isinstance(v, (int, float)) else 0.0 for v in vals]
        bars = ax.bar(xs, heights, color="#3b75af")
        for bar, v in zip(bars, vals, strict=True):
            label = MISSING if not isinstance(v, (int, float)) else f"{v:.3g}"
            ax.annotate(label, (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                        ha="center", va="bottom", fontsize=9)
        ax.set_xticks(list(xs), names, fontsize=8, rotation=10)
        ax.set_title(title)
        ax.set_ylabel(ylabel)
        ax.margins(y=0.15)
        fig.tight_layout()
        path = out / f"{stem}.png"
        fig.savefig(path)
        plt.close(fig)
        paths.append(path)
    return paths


# --- The results page: docs/benchmarks.md, generated from the result files --------------------

PAGE = "docs/benchmarks.md"
RESULTS_DIR = "results"  # <benchmark>.<machine>.json, `schema.RESULTS_SCHEMA`
SUITE_DIR = "docs/bench_results"  # bench.py suite documents, `schema.SCHEMA`
MAX_PAGE_LINES = 200
# The page's sections in order, each with its benchmarks in order; a result file names its area
# and benchmark, and one not listed here comes after these (areas, then benchmarks, by name).
AREAS = (
    ("Whole GRPO step vs TRL and Tunix", ("rl-step",)),
    ("Generator decode", ("generate", "generate-engine", "disaggregated")),
    ("8-bit generators", ("generate-8bit",)),
    ("Trainer and the memory of the RL step", ("train",)),
    ("Weight sync", ("reshard",)),
    ("Pipeline modes, rebalancing and staleness", ("pipeline", "rebalance", "staleness")),
    ("Sandbox pool, HumanEval and math checkers", ("sandbox", "humaneval", "math")),
    ("Default experiment, SFT and command-line errors", ("default-experiment", "sft", "cli")),
    ("Multi-turn episodes and the service", ("agentic", "service")),
    ("Cross-hardware suite", ()),
    ("Accelerator check and pending figures", ("device-check", "kernels")),
)
SUITE_AREA = "Cross-hardware suite"
# the suite figures the page lists for each suite document (labels of `ROWS`)
SUITE_ROWS = ("RL step time, sync (s)", "async speedup over sync", "trainer MFU (vs measured peak)",
              "generator tokens/s per chip", "sandbox executions/s per core")
STATUS_TEXT = {"met": "met", "not_met": "**not met**", "unreachable": "**out of reach**",
               "pending": "pending", "measured": "measured", "failed": "**failed**"}
_HEADER = """\
# Benchmarks

The current figures, written by `python launch/report.py --page` from the result files
`results/<benchmark>.<machine>.json` (fields: `RESULTS_SCHEMA` in `jaxrl/benchmarks/schema.py`)
and the suite documents in `docs/bench_results/`; `tests/test_results_page.py` fails when the page
and the files disagree. Edit a record, not this page: a re-measured figure takes its new command,
load, date and commit; one that did not hold keeps a one-line `correction`. How the figures were
reached is in the commit messages; what measuring taught, in docs/design.md ("Lessons from
measuring"). Ratios are medians of paired per-round ratios (rounds in brackets), contenders
interleaved, each framework in its own process, unless a row says otherwise. `commit` recorded the
figure; `code` is the code measured. The machines are described at the end."""


def load_results(root: Path) -> list[dict]:
    """Every result file under `root/RESULTS_DIR`, sorted by name, checked against the schema and
    its name (`<benchmark>.<machine>.json`); numbers are `Decimal`s, so they print as written."""
    docs = []
    for path in sorted((root / RESULTS_DIR).glob("*.json")):
        text = path.read_text()
        try:
            doc = json.loads(text)
            if not isinstance(doc, dict) or doc.get("kind") != "results":
                raise SchemaError('(document): not a result file ("kind": "results")')
            validate(doc)
        except (json.JSONDecodeError, SchemaError) as e:
            raise SchemaError(f"{RESULTS_DIR}/{path.name}: {e}") from None
        expected = f"{doc['benchmark']}.{doc['machine']['name']}.json"
        if path.name != expected:
            raise SchemaError(f"{RESULTS_DIR}/{path.name}: a result file is named "
                              f"<benchmark>.<machine>.json, here {expected}")
        docs.append(json.loads(text, parse_float=decimal.Decimal))
    return docs


def load_suite_docs(root: Path) -> list[dict]:
    """Every suite document under `root/SUITE_DIR`, sorted by name, checked against the schema."""
    docs = []
    for path in sorted((root / SUITE_DIR).glob("*.json")):
        try:
            doc = json.loads(path.read_text())
            validate(doc)
        except (json.JSONDecodeError, SchemaError) as e:
            raise SchemaError(f"{SUITE_DIR}/{path.name}: {e}") from None
        docs.append(doc)
    return docs


def anchor(title: str) -> str:
    """The anchor GitHub gives a heading: lower case, punctuation dropped, spaces as hyphens."""
    return re.sub(r"[^a-z0-9 _-]", "", title.lower()).replace(" ", "-")


def _cell(text: str) -> str:
    return str(text).replace("|", "\\|")


def _num(v) -> str:
    if isinstance(v, int) and not isinstance(v, bool) and abs(v) >= 100_000:
        return f"{v:,}"
    return str(v)  # a Decimal prints as the file wrote it


def _amount(value, runs, unit) -> str:
    if value is None and not runs:
        return ""
    text = _num(value) if value is not None else ", ".join(map(_num, runs))
    if not unit:
        return text
    return text + unit if unit in ("%", "x") else f"{text} {unit}"


def _result(rec: dict) -> str:
    text = _amount(rec["value"], rec.get("runs"), rec.get("unit"))
    if text and "before" in rec:
        text = f"{_num(rec['before'])} -> {text}"
    return text or MISSING


def _peer(rec: dict) -> str:
    peer = rec.get("peer")
    if peer is None:
        return MISSING
    amount = _amount(peer["value"], peer.get("runs"), peer.get("unit", rec.get("unit")))
    return f"{peer['name']}: {amount}" if amount else peer["name"]


def _ratio(rec: dict) -> str:
    if "ratio" not in rec:
        return MISSING
    rounds = rec.get("ratio_rounds")
    text = f"{_num(rec['ratio'])}x"
    if rounds:
        text += f" ({', '.join(map(_num, rounds))})"
    return f"{text}, {rec['ratio_of']}"


def _status(rec: dict) -> str:
    status = STATUS_TEXT[rec["status"]]
    return f"{rec['target']}: {status}" if "target" in rec else status


def _record_cells(rec: dict, machine: str) -> list[str]:
    figure = rec["name"]
    if "note" in rec:
        figure += f"<br>{rec['note']}"
    if "correction" in rec:
        figure += f"<br>**{rec['correction']}**"
    where = "; ".join([machine, *([rec["threads"]] if "threads" in rec else []),
                       *([f"load {rec['load']}"] if rec["load"] else [])])
    when = f"{rec['date']} {rec['time']}" if "time" in rec else rec["date"]
    code = rec.get("code")
    commit = rec["commit"] + (f" (code {code})" if code and code != rec["commit"] else "")
    how = "; ".join([*([f"`{rec['command']}`"] if "command" in rec else []),
                     *([rec["method"]] if "method" in rec else [])])
    return [figure, _result(rec), _peer(rec), _ratio(rec), _status(rec), how, where, when,
            commit]


def _suite_cells(doc: dict) -> list[list[str]]:
    """The page's rows for one suite document: the `SUITE_ROWS` figures, its command and load."""
    m = doc["machine"]
    start = ", ".join(f"{x:.2f}" for x in m["load_average"])
    end = m.get("load_average_end")
    load = f"load {start}" + (f" -> {', '.join(f'{x:.2f}' for x in end)}" if end else "")
    created = doc["created"]
    when = f"{created[:10]} {created[11:16]} UTC" if created.endswith("+00:00") else created
    commit = m["jaxrl_commit"]
    code = "code " + commit[:7] + ("+modified" if commit.endswith("+modified") else "")
    rows = {label: (where, key, kind) for label, where, key, kind in ROWS}
    out = []
    for label in SUITE_ROWS:
        where, key, kind = rows[label]
        out.append([f"{label}, size `{doc['size']}`", fmt(value(doc, where, key), kind),
                    MISSING, MISSING, STATUS_TEXT["measured"], f"`{doc['command']}`",
                    f"{m['name']}; {load}", when, code])
    return out


def _machines(results: list[dict], suite_docs: list[dict]) -> dict[str, str]:
    machines: dict[str, str] = {}
    described = [(d["machine"]["name"], d["machine"]["description"]) for d in results]
    for d in suite_docs:
        m = d["machine"]
        described.append((m["name"], f"{m['host_cpu']}, {m['host_cores']} cores, {m['backend']} "
                                     f"backend ({m['device_count']} devices), jax {m['jax']}"))
    for name, description in described:
        if machines.setdefault(name, description) != description:
            raise SchemaError(f"machine {name!r} is described two ways: {machines[name]!r} and "
                              f"{description!r}")
    return dict(sorted(machines.items()))


def _table(head: list[str], rows: list[list[str]]) -> list[str]:
    return ["| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(_cell(c) for c in row) + " |" for row in rows)]


def render_page(root: Path) -> str:
    """docs/benchmarks.md as the result files and suite documents under `root` make it."""
    results = load_results(root)
    suite_docs = load_suite_docs(root)
    order = {area: (i, {b: j for j, b in enumerate(benches)})
             for i, (area, benches) in enumerate(AREAS)}
    areas = sorted({d["area"] for d in results} | ({SUITE_AREA} if suite_docs else set()),
                   key=lambda a: (order.get(a, (len(order),))[0], a))

    def file_key(d):  # listed benchmarks first, in order; then by name (and machine)
        listed = order.get(d["area"], (0, {}))[1]
        return (listed.get(d["benchmark"], len(listed)), d["benchmark"], d["machine"]["name"])

    by_area = {a: sorted((d for d in results if d["area"] == a), key=file_key) for a in areas}
    summary = []
    for area in areas:
        for d in by_area[area]:
            for rec in d["records"]:
                if "headline" in rec:
                    summary.append([rec["headline"], _result(rec), _peer(rec), _ratio(rec),
                                    _status(rec), f"[{area}](#{anchor(area)})"])
    lines = [_HEADER, "", "## Summary", ""]
    lines += _table(["what", "result", "peer", "ratio", "target: status", "rows"], summary)
    row_head = ["figure", "result", "peer", "ratio", "target: status", "command or method",
                "machine; load", "date", "commit"]
    for area in areas:
        lines += ["", f"## {area}", ""]
        abouts = [f"`{d['benchmark']}`: {d['about']}" for d in by_area[area] if "about" in d]
        if area == SUITE_AREA and suite_docs:
            abouts.append("`suite`: `python launch/bench.py suite` runs one fixed workload on "
                          f"every machine (docs/benchmark_schema.md); its documents are in "
                          f"`{SUITE_DIR}/`; compare rows of one `size` only.")
        if abouts:
            lines += [" ".join(abouts), ""]
        rows = [_record_cells(rec, d["machine"]["name"])
                for d in by_area[area] for rec in d["records"]]
        if area == SUITE_AREA:
            rows += [row for doc in suite_docs for row in _suite_cells(doc)]
        lines += _table(row_head, rows)
    lines += ["", "## Machines", ""]
    lines += _table(["machine", "description"], [list(kv) for kv in
                                                 _machines(results, suite_docs).items()])
    return "\n".join(lines) + "\n"


def write_page(root: Path, check: bool = False) -> int:
    """Write (or with `check`, compare) `root/PAGE`; 1 when it differs, 2 on a bad file."""
    try:
        text = render_page(root)
    except SchemaError as e:
        print(f"report.py: {e}", file=sys.stderr)
        return 2
    n = text.count("\n")
    if n > MAX_PAGE_LINES:
        print(f"report.py: the page would be {n} lines, more than {MAX_PAGE_LINES}: shorten the "
              "records' notes or keep fewer figures", file=sys.stderr)
        return 2
    path = root / PAGE
    if check:
        if path.is_file() and path.read_text() == text:
            return 0
        print(f"report.py: {PAGE} is not what the result files generate: run python "
              "launch/report.py --page", file=sys.stderr)
        return 1
    path.write_text(text)
    print(f"report.py: wrote {PAGE} ({n} lines)", file=sys.stderr)
    return 0
