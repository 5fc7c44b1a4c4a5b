"""`python launch/bench.py suite [--size smoke|small|full] --json OUT.json [--name NAME]`.

Runs the benchmarks one after another in this process -- generate, train, reshard, sandbox,
pipeline, kernels (GPU/TPU only) and the end-to-end RL step of one fixed workload
(configs/bench_suite.py) -- and writes one JSON document (schema: jaxrl/benchmarks/schema.py,
documented in docs/benchmark_schema.md): the machine, the matmul peak and memory bandwidth
measured at the start of the run, and per benchmark its figures, its peer's figures from the same
run, and roofline fractions. A benchmark that cannot run here is recorded as "skipped" with the
reason; one that raises is recorded as "failed" and the others still run. Each benchmark's text
report goes to stdout as it runs; progress lines go to stderr.

`--size` picks each benchmark's settings (`SIZES`); the RL-step workload is the same at every
size and on every backend (only its number of steps changes), so rows compare across machines.
Per-chip figures divide by `machine.chips`: the device count on an accelerator, 1 on a CPU
backend (its simulated devices share the host's cores).
"""

from __future__ import annotations

import argparse
import datetime
import functools
import importlib.util
import json
import math
import os
import platform
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path

from jaxrl.benchmarks import generate, pipeline, reshard, sandbox, train
from jaxrl.benchmarks.generate import measure_machine
from jaxrl.benchmarks.report import markdown_table
from jaxrl.benchmarks.schema import BENCHMARK_NAMES, SCHEMA_VERSION, SIZES, validate
from jaxrl.config import load_config

ROOT = Path(__file__).resolve().parents[2]
WORKLOAD_CONFIG = ROOT / "configs" / "bench_suite.py"
CPU_DEVICES = 8  # simulated CPU devices: reshard's default meshes (2x2 trainer, 1x4 generator)

# Per size, each benchmark's command-line options (its own parser validates them). "full" is each
# benchmark's defaults: the settings of the figures in docs/benchmarks.md.
SIZES_ARGV = {
    "smoke": {
        "generate": ["--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4",
                     "--kv-heads", "2", "--vocab", "128", "--batch", "8", "--prompt", "16",
                     "--new", "16", "--chunk-steps", "8", "--repeats", "1"],
        "train": ["--model", "tiny", "--batch", "8", "--seq", "64", "--steps", "1", "--warmup",
                  "1", "--micro-batches", "1", "--chunk", "64"],
        "reshard": ["--model", "tiny", "--trainer", "2x1", "--generator", "1x2", "--repeats",
                    "3", "--warmup", "1"],
        "kernels": ["--iters", "3", "--prefill-tokens", "8192"],
    },
    "small": {
        "generate": ["--batch", "16", "--new", "64", "--repeats", "2"],
        "train": ["--batch", "8", "--seq", "256", "--steps", "2", "--warmup", "1"],
        "reshard": ["--repeats", "3"],
        "kernels": ["--iters", "5"],
    },
    "full": {"generate": [], "train": [], "reshard": [], "kernels": []},
}
SANDBOX_JOBS = {"smoke": (200, 20), "small": (1000, 50), "full": (2000, 100)}  # warm, fresh
PIPELINE = {"smoke": dict(steps=3, warmup=1, modes=["sync", "async"]),
            "small": dict(steps=6, warmup=2, modes=["sync", "periodic", "async"]),
            "full": dict(steps=12, warmup=2, modes=["sync", "periodic", "async", "inflight"])}

progress = functools.partial(print, file=sys.stderr, flush=True)


class Skip(Exception):
    """A benchmark that cannot run on this machine or at this size; the message says why."""


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench.py suite", description=__doc__.splitlines()[0])
    p.add_argument("--size", default="smoke", help=f"one of {', '.join(SIZES)}")
    p.add_argument("--json", required=True, help="write the result document here")
    p.add_argument("--name", default=None,
                   help="this machine's row name (default: backend, device kind, host cores)")
    p.add_argument("--only", default=None,
                   help="comma-separated benchmarks to run (the others are recorded as skipped)")
    args = p.parse_args(argv)
    if args.size not in SIZES:
        p.error(f"--size must be one of {', '.join(SIZES)}, got {args.size!r}")
    out_dir = Path(args.json).resolve().parent
    if not out_dir.is_dir():
        p.error(f"--json: directory {str(out_dir)!r} does not exist")
    if args.name is not None and not args.name.strip():
        p.error("--name must not be empty")
    args.only = None if args.only is None else [x for x in args.only.split(",") if x]
    bad = [x for x in args.only or [] if x not in BENCHMARK_NAMES]
    if bad:
        p.error(f"--only: unknown benchmarks {bad}; valid: {', '.join(BENCHMARK_NAMES)}")
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)  # before JAX: a bad argument is answered at once
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={CPU_DEVICES}"
    doc = run(args.size, name=args.name, only=args.only,
              command="python launch/bench.py suite " + " ".join(argv))
    try:
        validate(doc)
    except ImportError as e:
        progress(f"suite: not validated ({e})")
    write_json(args.json, doc)
    print(markdown_table([doc]))  # the headline figures, for people
    progress(f"suite: wrote {args.json}")
    failed = [k for k, v in doc["benchmarks"].items() if v["status"] == "failed"]
    return 1 if failed else 0


def write_json(path: str | os.PathLike, doc: dict) -> None:
    """Atomically: a reader never sees a half-written file."""
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(doc, indent=1, allow_nan=False) + "\n")
    os.replace(tmp, path)


def run(size: str, *, name: str | None = None, only: list[str] | None = None,
        command: str = "") -> dict:
    """The suite's result document (see the module docstring)."""
    import jax

    with tempfile.TemporaryDirectory(prefix="jaxrl-suite-xla-") as cache:
        if not getattr(jax.config, "jax_compilation_cache_dir", "unknown"):
            # identical programs compiled again (the RL step's trainer and generator in each
            # pipeline mode) load from this run's cache: only warm-up steps, which no figure
            # counts, get faster
            jax.config.update("jax_compilation_cache_dir", cache)
            jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        try:
            return _run(size, name, only, command)
        finally:
            if getattr(jax.config, "jax_compilation_cache_dir", None) == cache:
                jax.config.update("jax_compilation_cache_dir", None)


def _run(size, name, only, command) -> dict:
    machine = machine_info(name)
    progress(f"suite: {machine['name']}, size {size}; measuring matmul peak and bandwidth")
    probe = measure_machine()
    roofline = {"matmul_peak_flops": probe["matmul_gflops"] * 1e9,
                "memory_gbps": probe["mem_gbps"],
                "method": "best of 5: jitted f32 2048x2048 matmul (default precision) and jitted "
                          "sum over a 256 MiB f32 array (bytes read / time), on device 0"}
    ctx = dict(size=size, machine=machine, roofline=roofline, pipeline=None)
    entries = {"generate": _generate, "train": _train, "reshard": _reshard,
               "sandbox": _sandbox, "rl_step": _rl_step, "pipeline": _pipeline,
               "kernels": _kernels}
    benchmarks = {}
    for bench, fn in entries.items():
        if only is not None and bench not in only:
            benchmarks[bench] = _entry("skipped", "not in --only", 0.0)
            continue
        progress(f"suite: {bench} starts")
        t0 = time.perf_counter()
        try:
            figures, peer, roof, cmd = fn(ctx)
            benchmarks[bench] = _entry("ok", None, time.perf_counter() - t0, cmd, figures, peer,
                                       roof)
        except Skip as e:
            benchmarks[bench] = _entry("skipped", str(e), time.perf_counter() - t0)
        except Exception as e:  # noqa: BLE001 - record it; the other benchmarks still run
            traceback.print_exc()
            benchmarks[bench] = _entry("failed", f"{type(e).__name__}: {e}"[:500],
                                       time.perf_counter() - t0)
        b = benchmarks[bench]
        progress(f"suite: {bench} {b['status']} in {b['seconds']:.1f} s"
                 + (f" ({b['reason']})" if b["reason"] else ""))
    machine["load_average_end"] = list(os.getloadavg())
    return {"schema_version": SCHEMA_VERSION, "size": size,
            "created": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
            "command": command, "machine": machine, "roofline": roofline,
            "workload": workload(), "benchmarks": benchmarks}


def _entry(status, reason, seconds, command=None, figures=None, peer=None, roofline=None):
    return {"status": status, "reason": reason, "seconds": round(seconds, 3),
            "command": command, "figures": flat(figures or {}),
            "peer": None if peer is None else {"name": peer[0], "figures": flat(peer[1])},
            "roofline": flat(roofline or {})}


def flat(d: dict, prefix: str = "") -> dict:
    """Nested results as one level ("a/b"); non-finite floats as null (JSON has no NaN)."""
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(flat(v, key + "/"))
        elif isinstance(v, (list, tuple)):
            out[key] = ", ".join(str(x) for x in v)
        elif isinstance(v, float) and not math.isfinite(v):
            out[key] = None
        elif v is None or isinstance(v, (bool, int, float, str)):
            out[key] = v
        else:
            out[key] = str(v)
    return out


def workload() -> dict:
    """The fixed RL-step workload (configs/bench_suite.py), as recorded in every document."""
    cfg = load_config(str(WORKLOAD_CONFIG), [])
    m = cfg.model
    return {"config": "configs/bench_suite.py", "model_params": m.num_params(),
            "layers": m.num_layers, "hidden": m.hidden_size, "heads": m.num_heads,
            "kv_heads": m.num_kv_heads, "vocab": m.vocab_size, "task": cfg.data.task,
            "difficulty": cfg.data.difficulty, "prompts_per_step": cfg.data.prompts_per_step,
            "group_size": cfg.data.group_size, "max_new_tokens": cfg.data.max_new_tokens,
            "trainer_devices": 1, "generator_devices": 1}


def machine_info(name: str | None) -> dict:
    import flax
    import jax
    import jaxlib

    devices = jax.devices()
    backend = jax.default_backend()
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    try:
        limit = devices[0].memory_stats().get("bytes_limit")
    except Exception:  # noqa: BLE001 - CPU devices have no memory stats
        limit = None
    kind = devices[0].device_kind
    return {
        "name": name or f"{backend}-{kind}-{cores}core".replace(" ", "_"),
        "backend": backend, "device_kind": kind, "device_count": len(devices),
        "chips": 1 if backend == "cpu" else len(devices),
        "device_memory_bytes": None if limit is None else int(limit),
        "host_memory_bytes": os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"),
        "host_cpu": _cpu_model(), "host_cores": cores, "load_average": list(os.getloadavg()),
        "jax": jax.__version__, "jaxlib": jaxlib.__version__, "flax": flax.__version__,
        "python": platform.python_version(), "jaxrl_commit": _commit(),
    }


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine() or "unknown"


def _commit() -> str:
    """The checkout's commit ("+modified" when tracked files differ from it), else "unknown"."""
    try:
        git = functools.partial(subprocess.run, cwd=ROOT, capture_output=True, text=True,
                                timeout=10, check=True)
        head = git(["git", "rev-parse", "HEAD"]).stdout.strip()
        dirty = git(["git", "status", "--porcelain", "--untracked-files=no"]).stdout.strip()
        return head + ("+modified" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def _cmd(bench: str, argv: list[str]) -> str:
    return " ".join(["python launch/bench.py", bench, *argv])


def _generate(ctx):
    argv = list(SIZES_ARGV[ctx["size"]]["generate"])
    peer_reason = _peer_missing("torch", ctx["size"]) or _peer_missing("transformers", ctx["size"])
    if peer_reason is None:
        argv += ["--vs", "hf"]
    r = generate.run(generate._parse(argv))
    figures = {"tokens_per_s": r["jaxrl_tokens_per_s"],
               "tokens_per_s_per_chip": r["jaxrl_tokens_per_s"],  # one engine on one device
               "decode_tokens_per_s": r["jaxrl_decode_tokens_per_s"],
               "decode_step_ms": r["jaxrl_step_ms"], "slot_utilisation": r["slot_utilisation"],
               "ratio_vs_peer": r.get("ratio"), "peer_skipped": peer_reason}
    peer = None if peer_reason else ("transformers.generate", {
        "tokens_per_s": r["hf_tokens_per_s"], "decode_tokens_per_s": r["hf_decode_tokens_per_s"]})
    roof = {"bandwidth_frac": r["bandwidth_frac"], "flops_frac": r["flops_frac"],
            "own_probe_memory_gbps": r["mem_gbps"], "own_probe_matmul_gflops": r["matmul_gflops"]}
    return figures, peer, roof, _cmd("generate", argv)


def _train(ctx):
    argv = list(SIZES_ARGV[ctx["size"]]["train"])
    peer_reason = _peer_missing("torch", ctx["size"]) or _peer_missing("transformers", ctx["size"])
    if peer_reason is None:
        argv += ["--vs", "torch"]
    r = train.run(train._parser().parse_args(argv))
    chips = ctx["machine"]["chips"]
    tokens = r["batch"] * r["seq"]
    step_flops = r["flops_per_token"] * tokens  # `jaxrl.train.flops`: 6 N + attention
    peak = ctx["roofline"]["matmul_peak_flops"]
    figures = {"model_params": r["model_params"], "batch": r["batch"], "seq": r["seq"],
               "step_s": r["jax_step_s"], "tokens_per_s": r["jax_tokens_per_s"],
               "tokens_per_s_per_chip": r["jax_tokens_per_s"] / chips,
               "ratio_vs_peer": r.get("ratio_vs_torch"), "peer_skipped": peer_reason}
    peer = None if peer_reason else ("transformers + torch.optim.AdamW", {
        "step_s": r["torch_step_s"], "tokens_per_s": r["torch_tokens_per_s"]})
    roof = {"mfu": step_flops / r["jax_step_s"] / (peak * chips),
            "mfu_vs_backend_peak": r["jax_mfu"] / chips,
            "mfu_vs_probe_same_iteration": r["jax_mfu_vs_probe"] / chips}
    return figures, peer, roof, _cmd("train", argv)


def _reshard(ctx):
    argv = list(SIZES_ARGV[ctx["size"]]["reshard"])
    args = reshard._parser().parse_args(argv)
    need = args.trainer[0] * args.trainer[1] + args.generator[0] * args.generator[1]
    if ctx["machine"]["device_count"] < need:
        raise Skip(f"needs {need} devices for disjoint trainer {args.trainer} and generator "
                   f"{args.generator} meshes, have {ctx['machine']['device_count']}")
    r = reshard.run(args)
    figures = {k: r[k] for k in ("model_params", "bytes", "dtype", "weight_sync_s",
                                 "weight_sync_gbps", "speedup_vs_host")}
    figures["trainer_mesh"] = "x".join(str(v) for v in r["trainer_mesh"].values())
    figures["generator_mesh"] = "x".join(str(v) for v in r["generator_mesh"].values())
    peer = ("host round trip (device_get + device_put)",
            {"seconds": r["host_round_trip_s"], "gbps": r["host_round_trip_gbps"]})
    roof = {"weight_sync_vs_memory_bandwidth": r["weight_sync_gbps"]
            / ctx["roofline"]["memory_gbps"]}
    return figures, peer, roof, _cmd("reshard", argv)


def _sandbox(ctx):
    jobs, fresh = SANDBOX_JOBS[ctx["size"]]
    cores = ctx["machine"]["host_cores"]
    args = argparse.Namespace(jobs=jobs, baseline_jobs=fresh, tier="auto", humaneval_rounds=0)
    r = sandbox.run(args, cores)
    if r is None:
        raise RuntimeError("a sandbox execution gave a wrong result (see stderr)")
    figures = {k: r[k] for k in ("workers", "tier", "jobs", "exec_per_s", "exec_per_cpu_s",
                                 "p50_s", "p99_s", "start_p50_s", "ratio_vs_fresh")}
    figures["exec_per_s_per_core"] = r["exec_per_s"] / cores
    peer = ("fresh python3 per execution", {"exec_per_s": r["fresh_exec_per_s"],
                                            "exec_per_cpu_s": r["fresh_exec_per_cpu_s"],
                                            "p50_s": r["fresh_p50_s"]})
    cmd = _cmd("sandbox", ["--jobs", str(jobs), "--baseline-jobs", str(fresh),
                           "--humaneval-rounds", "0"])
    return figures, peer, {}, cmd


def _pipeline_results(ctx):
    """The fixed workload in each mode of this size (run once, shared by rl_step and pipeline)."""
    if ctx["pipeline"] is None:
        p = PIPELINE[ctx["size"]]
        argv = ["--config", str(WORKLOAD_CONFIG), "--steps", str(p["steps"]), "--warmup",
                str(p["warmup"]), "--modes", ",".join(p["modes"]), "--cpu-cores", "shared"]
        m = ctx["machine"]
        # one trainer chip and one generator chip; a single-chip machine time-shares its chip
        colocated = m["backend"] != "cpu" and m["device_count"] < 2
        if colocated:
            argv.append("--mesh.colocated=true")
        args, overrides = pipeline._parser().parse_known_args(argv)
        results, _ = pipeline.run(args, overrides, p["modes"], ["shared"])
        cmd = _cmd("pipeline", [a if a != str(WORKLOAD_CONFIG) else "configs/bench_suite.py"
                                for a in argv])
        chips = 1 if m["backend"] == "cpu" or colocated else 2
        ctx["pipeline"] = ({mode: f for (_, mode), f in results.items()}, cmd, chips, colocated)
    return ctx["pipeline"]


def _rl_figures(f: dict, chips: int) -> dict:
    """Wall-clock rollouts/s: the workload's rollouts per step / mean step time (the pipeline's
    `consumed/s` counts the trainer's busy time only, kept as `trainer_rollouts_per_busy_s`)."""
    w = workload()
    rollouts = w["prompts_per_step"] * w["group_size"]
    return {"step_s": f["step_s"], "rollouts_per_step": rollouts,
            "rollouts_per_s": rollouts / f["step_s"],
            "rollouts_per_s_per_chip": rollouts / f["step_s"] / chips,
            "trainer_rollouts_per_busy_s": f["consumed/s"],
            "trainer_idle_frac": f["trainer_idle"], "generator_idle_frac": f["gen_idle"],
            "weight_sync_gbps": f["sync_GB/s"], "reward_mean": f["reward"],
            "host_cpu_busy": f["host_cpu_busy"]}


def _rl_step(ctx):
    # on an accelerator the workload's trainer and generator are two chips (one time-shared
    # chip on a single-chip machine); on CPU one host
    by_mode, cmd, chips, colocated = _pipeline_results(ctx)
    figures = {"mode": "sync", "chips": chips, "colocated": colocated,
               **_rl_figures(by_mode["sync"], chips)}
    return figures, None, {}, cmd + " (its sync row)"


def _pipeline(ctx):
    by_mode, cmd, chips, _ = _pipeline_results(ctx)
    sync = by_mode["sync"]
    figures = {}
    for mode, f in by_mode.items():
        if mode != "sync":
            figures.update(flat(_rl_figures(f, chips), f"{mode}/"))
            figures[f"{mode}/speedup_vs_sync"] = sync["step_s"] / f["step_s"]
    return figures, ("sync mode", _rl_figures(sync, chips)), {}, cmd


def _kernels(ctx):
    if ctx["machine"]["backend"] == "cpu":
        raise Skip("Pallas kernels only interpret on a CPU backend, so timings would mean "
                   "nothing (`bench.py kernels --smoke` checks them there)")
    try:
        from jaxrl.benchmarks import kernels
    except ImportError as e:
        raise Skip(f"jaxrl_kernels not importable: {e}") from None
    argv = list(SIZES_ARGV[ctx["size"]]["kernels"])
    r = kernels.run(kernels._parse(argv), argv)
    if r is None:
        raise RuntimeError("a kernel disagrees with its reference (see stderr)")
    figures, peer, roof = {"copy_gbps": r["copy_GBps"]}, {}, {}
    for row in r["prefill"]:
        figures[f"prefill_T{row['T']}_tflops"] = row.get("pallas")
        for other in ("cudnn", "xla"):
            if other in row:
                peer[f"prefill_T{row['T']}_{other}_tflops"] = row[other]
    for row in r["decode"]:
        tag = f"decode_B{row['B']}_L{row['L']}"
        figures[f"{tag}_gbps"] = row["pallas_GBps"]
        figures[f"{tag}_paged_gbps"] = row["paged_GBps"]
        if "xla_GBps" in row:
            peer[f"{tag}_xla_gbps"] = row["xla_GBps"]
        if "pallas/copy" in row:
            roof[f"{tag}_vs_copy"] = row["pallas/copy"]
    name = "cuDNN / XLA reference" if any("cudnn" in k for k in peer) else "XLA reference"
    return figures, (name, peer) if peer else None, roof, _cmd("kernels", argv)


def _peer_missing(module: str, size: str) -> str | None:
    """Why the peer does not run (None when it does): skipped at smoke size (its import and
    compile cost more than the smoke budget), or its package is not installed."""
    if size == "smoke":
        return f"peer skipped at size smoke ({module} import and warm-up exceed its budget)"
    if importlib.util.find_spec(module) is None:
        return f"peer skipped: {module} is not installed"
    return None
