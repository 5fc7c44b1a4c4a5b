"""`python launch/report.py A.json B.json ... [--out DIR]`: suite results side by side.

Reads `bench.py suite` documents (any number of machines), checks each against the schema, prints
a markdown table with one column per document, and writes it with one PNG bar chart per headline
figure (`CHARTS`) into `--out`. A figure a document lacks (a skipped benchmark, a peer that did not
run) shows as "–" in the table and as a missing bar. Charts need matplotlib (the `bench` extra),
imported only when charts are drawn, with the Agg backend (no display).
"""

from __future__ import annotations

import argparse
import json
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
    p.add_argument("files", nargs="+", help="suite result documents (bench.py suite --json)")
    p.add_argument("--out", default="bench_report",
                   help="directory for report.md and the PNG charts (created)")
    p.add_argument("--no-charts", action="store_true", help="the table only (no matplotlib)")
    args = p.parse_args(argv)
    missing = [f for f in args.files if not Path(f).is_file()]
    if missing:
        p.error(f"no such file(s): {', '.join(missing)}")
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
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
