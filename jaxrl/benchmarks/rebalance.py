"""`python launch/bench.py rebalance`: a deliberately bad fixed split against `auto` from it.

Both runs start from the same split (`--start T:G`, by default 6:2 of 8 devices; T + G
simulated CPU devices without an accelerator) with a generator made slow
(`generate.debug_chunk_delay_s`, split among its devices, so it speeds up with chips): one keeps
that split (`pipeline.rebalance=off`), the other lets the live policy move devices
(`pipeline.rebalance=auto`, jaxrl/rl/rebalance.py). Same experiment, same steps, in the
same process; with `--repeats` the order alternates. Throughput is samples consumed per
wall-clock second over the steps after `--warmup` (the first compiles), from the end of the last
warm-up step to the end of the last, so the auto run pays for its moves, the compilation ahead
of them (the steps beside it are slower), any compilation they did not hide and the policy's
own time. Reported: the ratio
auto / fixed (median of the paired ratios) on a line of its own, the load average before and
after, each run's trainer idle fraction, and every move with its predicted rate and payback,
its compile-ahead (wall time, cost to the steps beside it), its pause and uncovered compilation
against 2 steps' time after it, and the rate and payback measured after it; the runs'
rebalancing log lines (why a step did not move). Each run starts once the compile-ahead of the
one before it (which may outlive it) has finished, and all share one persistent compilation
cache, so a split compiled in an earlier run loads from it. The policy estimates a
compile-ahead from the run's first step (jaxrl/rl/rebalance.py): with the cache empty the first
auto run compiles its candidate (16-18 s here) beside its steps and moves late, the later ones
load it; `--prewarm` first runs one step at every split, so that every candidate loads (a split
met before). The default delay makes the generator slow enough that the best split's steps are
about 2x faster than 6:2's; at `--delay 0.8` the generator's own compute, which 8 simulated
devices sharing 2 cores do not speed up, keeps every split within 1.45x of 6:2.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from jaxrl.config import PIPELINE_MODES as MODES
from jaxrl.config import load_config
from jaxrl.cpu import simulated_device_flags

MOVE_KEYS = ("rebalance/from_trainer_chips", "rebalance/to_trainer_chips",
             "rebalance/current_samples_per_s", "rebalance/predicted_samples_per_s",
             "rebalance/move_s", "rebalance/predicted_payback_steps")
MEASURED_KEYS = ("rebalance/measured_samples_per_s", "rebalance/recompile_s",
                 "rebalance/measured_cost_s", "rebalance/measured_payback_steps")
AHEAD_KEYS = ("rebalance/compile_ahead_s", "rebalance/compile_ahead_cost_s",
              "rebalance/compile_ahead_compiles", "rebalance/compile_ahead_cache_hits")


def _parser() -> argparse.ArgumentParser:
    root = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(prog="bench.py rebalance", description=__doc__)
    p.add_argument("--config", default=str(root / "configs" / "default.py"))
    p.add_argument("--start", default="6:2", help="the bad split both runs start from, T:G")
    p.add_argument("--delay", type=float, default=2.4,
                   help="generate.debug_chunk_delay_s: seconds per decode chunk, split among the "
                        "generator's devices (2.4: the best split's steps are ~2x faster than "
                        "6:2's; at 0.8 the generator's own compute, which simulated devices "
                        "sharing two cores do not speed up, leaves every split within 1.45x)")
    p.add_argument("--mode", default="sync", help=f"pipeline.mode (valid: {', '.join(MODES)})")
    p.add_argument("--steps", type=int, default=10)
    p.add_argument("--warmup", type=int, default=1, help="first steps left out (compilation)")
    p.add_argument("--min-interval", type=int, default=2, help="pipeline.rebalance_min_interval")
    p.add_argument("--confirm", type=int, default=1, help="pipeline.rebalance_confirm")
    p.add_argument("--cost", type=float, default=0.5,
                   help="pipeline.rebalance_cost_s: a move's assumed pause until measured (a "
                        "move must pay for it over the steps left; measured on a 2-core machine: "
                        "0.3-0.5 s)")
    p.add_argument("--repeats", type=int, default=3,
                   help="pairs of runs, the order alternating; the ratio is their median")
    p.add_argument("--cache-dir", default=None,
                   help="XLA's persistent compilation cache (default: JAX_COMPILATION_CACHE_DIR "
                        "if set, else a new one shared by this benchmark's runs: the first run "
                        "compiles, a split met in an earlier run loads its executables)")
    p.add_argument("--prewarm", action="store_true",
                   help="before the pairs, one step at every split T':G' of the devices (not "
                        "timed), so the persistent cache holds them all: a split met before "
                        "loads instead of compiling (without it the cache starts empty and a "
                        "cold run's policy judges a move against a cold compilation)")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p


def parse_split(text: str) -> tuple[int, int]:
    """"T:G" -> (T, G), both >= 1; a clear error otherwise."""
    parts = text.split(":")
    if len(parts) != 2 or not all(p.strip().isdigit() and int(p) >= 1 for p in parts):
        raise SystemExit(f"--start must be T:G with whole numbers >= 1 (e.g. 6:2), got {text!r}")
    return int(parts[0]), int(parts[1])


def check_args(args) -> None:
    """Every argument checked before JAX is imported."""
    parse_split(args.start)
    if args.mode not in MODES:
        raise SystemExit(f"--mode {args.mode!r} is not valid; valid: {list(MODES)}")
    for flag, value in (("--delay", args.delay), ("--cost", args.cost)):
        if not (np.isfinite(value) and value >= 0):
            raise SystemExit(f"{flag} must be a finite number >= 0, got {value}")
    if args.warmup < 0 or args.steps <= args.warmup:
        raise SystemExit(f"need 0 <= --warmup < --steps, got warmup {args.warmup}, steps "
                         f"{args.steps}")
    if args.repeats < 1 or args.min_interval < 0 or args.confirm < 1:
        raise SystemExit(f"need --repeats >= 1, --min-interval >= 0, --confirm >= 1; got "
                         f"{args.repeats}, {args.min_interval}, {args.confirm}")


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    check_args(args)
    t, g = parse_split(args.start)
    if "XLA_FLAGS" not in os.environ:  # on a CPU backend, T + G simulated devices
        os.environ["XLA_FLAGS"] = simulated_device_flags(t + g)
    import jax

    devices = jax.devices()
    if t + g != len(devices):
        raise SystemExit(f"--start {args.start} needs {t + g} devices; there are {len(devices)} "
                         f"({devices[0].platform})")
    load_before = os.getloadavg()
    runs: dict[str, list[dict]] = {"fixed": [], "auto": []}
    with tempfile.TemporaryDirectory(prefix="jaxrl-bench-") as tmp:
        cache = args.cache_dir or jax.config.jax_compilation_cache_dir or str(Path(tmp) / "xla")
        jax.config.update("jax_compilation_cache_dir", cache)
        jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
        prewarm_s = _prewarm(args, overrides, tmp, t + g) if args.prewarm else None
        for r in range(args.repeats):
            for policy in (("fixed", "auto") if r % 2 == 0 else ("auto", "fixed")):
                runs[policy].append(_run(args, overrides, tmp, policy, (t, g), tag=str(r)))
    ratios = [a["samples_per_s"] / f["samples_per_s"]
              for a, f in zip(runs["auto"], runs["fixed"], strict=True)]
    report = {"start": args.start, "mode": args.mode, "delay_s": args.delay,
              "steps": args.steps, "warmup": args.warmup, "devices": len(devices),
              "platform": devices[0].platform, "ratio_auto_vs_fixed": float(np.median(ratios)),
              "ratios": ratios, "runs": runs, "load_before": load_before,
              "load_after": os.getloadavg(), "cpus": os.cpu_count(), "cache_dir": cache,
              "batch": runs["fixed"][0]["batch"], "prewarm_s": prewarm_s}
    _print(report, Path(args.config).name)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=1))
    return 0


def _prewarm(args, overrides: list[str], tmp: str, total: int) -> float:
    """One untimed step at every split, so the persistent cache holds each; its seconds.
    The runs are `rebalance=auto` (one step: no move), so they also record their split as
    compiled into the cache (`CompiledSplits`), as a run that met it would."""
    t0 = time.perf_counter()
    for trainer in range(1, total):
        print(f"prewarm: one step at {trainer}:{total - trainer}", flush=True)
        _run(args, overrides, tmp, "auto", (trainer, total - trainer), tag=f"prewarm{trainer}",
             steps=1)
    return time.perf_counter() - t0


def _run(args, overrides: list[str], tmp: str, policy: str, split: tuple[int, int],
         tag: str, steps: int | None = None) -> dict | None:
    from jaxrl.run import run

    cfg = load_config(args.config, [
        *overrides, f"--name=rebalance-{policy}-{tag}", f"--run_dir={tmp}",
        f"--mesh.trainer={split[0]}x1", f"--mesh.generator={split[1]}x1",
        f"--pipeline.mode={args.mode}", f"--pipeline.steps={steps or args.steps}",
        f"--pipeline.rebalance={'auto' if policy == 'auto' else 'off'}",
        f"--pipeline.rebalance_min_interval={args.min_interval}",
        f"--pipeline.rebalance_confirm={args.confirm}",
        f"--pipeline.rebalance_cost_s={args.cost}",
        f"--generate.debug_chunk_delay_s={args.delay}", "--train.checkpoint_every=0",
    ])
    t0 = time.perf_counter()
    handler = _LogLines(f"{policy}-{tag}")
    logger = logging.getLogger("jaxrl")
    level = logger.level
    logger.setLevel(logging.INFO)
    logger.addHandler(handler)
    try:
        history = run(cfg, progress=False, evaluate=False).history
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
    wall_s = time.perf_counter() - t0
    for thread in threading.enumerate():  # a compile-ahead the run outlived: not in the next run
        if thread.name.startswith("jaxrl-compile-ahead"):
            thread.join()
    if steps is not None:  # a prewarm run: not timed
        return None
    return figures(history, args.warmup, cfg.data.prompts_per_step * cfg.data.group_size,
                   wall_s=wall_s)


class _LogLines(logging.Handler):
    """Prints the run's rebalancing log lines (why it moved or did not) and its warnings."""

    def __init__(self, run: str):
        super().__init__(logging.INFO)
        self.run = run

    def emit(self, record: logging.LogRecord) -> None:
        message = record.getMessage()
        if record.levelno >= logging.WARNING or message.startswith("rebalance"):
            print(f"  [{self.run}] {message}", flush=True)


def figures(history: list[dict], warmup: int, batch: int, *, wall_s: float = float("nan")
            ) -> dict:
    """One run's figures from its metrics rows: samples consumed per second over the steps after
    `warmup`, the mean trainer idle fraction over them, the final split and every move (with
    its measured effect, logged on a later row). Their time is the wall clock from the last
    warm-up step's row to the last row (each row is written once its step, hooks and move are
    done: everything the run did in between counts); rows without `time` (or no warm-up step)
    count the steps' windows, `pipeline/step_s`, plus the pauses of the moves made after them,
    `rebalance/move_s` (`windows_s`, reported too)."""
    timed = history[warmup:]
    windows = sum(r["pipeline/step_s"] + r.get("rebalance/move_s", 0.0) for r in timed[:-1]) + \
        timed[-1]["pipeline/step_s"]  # a move after the last step would not be timed
    clocked = warmup >= 1 and all("time" in r for r in history[warmup - 1:])
    span = history[-1]["time"] - history[warmup - 1]["time"] if clocked else windows
    moves: list[dict] = []
    ahead: dict = {}
    for r in history:  # a measurement belongs to the last move before it
        if "rebalance/measured_cost_s" in r and moves:
            moves[-1].update(_picked(r, MEASURED_KEYS), at_step=r["step"])
        if "rebalance/compile_ahead_s" in r:  # the compile-ahead of the next move
            ahead = _picked(r, AHEAD_KEYS)
        if "rebalance/move_s" in r:
            moves.append(_picked(r, MOVE_KEYS) | {"after_step": r["step"]} | ahead)
            ahead = {}
    out = {"samples_per_s": batch * len(timed) / span, "timed_s": span, "windows_s": windows,
           "wall_s": wall_s,
           "batch": batch,
           "trainer_idle": _mean(timed, "pipeline/trainer_idle_frac"),
           "final_split": [history[-1]["pipeline/trainer_chips"],
                           history[-1]["pipeline/generator_chips"]],
           "moves": moves}
    if moves and "at_step" in moves[-1]:  # the timed steps before the first move, and from the
        # last move's first settled step on (the settle steps between are left out)
        before = [r for r in timed if r["step"] <= moves[0]["after_step"]]
        after = [r for r in timed if r["step"] >= moves[-1]["at_step"]]
        for name, rows in (("before", before), ("after", after)):
            out[name] = {"trainer_idle": _mean(rows, "pipeline/trainer_idle_frac"),
                         "produced_per_s": _mean(rows, "pipeline/rollouts_per_s_produced"),
                         "samples_per_s": batch * len(rows) / sum(
                             r["pipeline/step_s"] for r in rows) if rows else float("nan"),
                         "steps": [r["step"] for r in rows]}
    return out


def _picked(row: dict, keys) -> dict:
    """The columns `keys` of a metrics row, as floats (a row holds inf as "inf")."""
    return {k.split("/")[1]: float(row[k]) for k in keys if k in row}


def _mean(rows: list[dict], key: str) -> float:
    return float(np.mean([r[key] for r in rows])) if rows else float("nan")


def _print(report: dict, config: str) -> None:
    nan = float("nan")
    print(f"rebalance benchmark: {report['steps']} steps ({report['warmup']} warm-up left out), "
          f"mode {report['mode']}, start {report['start']} of {report['devices']} "
          f"{report['platform']} devices, generator delay {report['delay_s']} s per chunk, "
          f"config {config}")
    load = lambda xs: " ".join(f"{x:.2f}" for x in xs)
    print(f"load average (1, 5, 15 min) before {load(report['load_before'])}, after "
          f"{load(report['load_after'])}, on {report['cpus']} CPUs; persistent compilation "
          f"cache {report['cache_dir']}")
    if report.get("prewarm_s") is not None:
        print(f"prewarmed: every split run one step first ({report['prewarm_s']:.0f} s, not "
              f"timed), so the cache holds each split's executables")
    for policy, fs in report["runs"].items():
        for i, f in enumerate(fs):
            split = ":".join(str(int(x)) for x in f["final_split"])
            print(f"  {policy:<6} run {i}: {f['samples_per_s']:8.3f} samples/s over "
                  f"{f['timed_s']:.1f} s, trainer idle {f['trainer_idle']:.1%}, ends at {split}")
            for m in f["moves"]:
                line = (f"    move after step {m['after_step']}: {int(m['from_trainer_chips'])} "
                        f"-> {int(m['to_trainer_chips'])} trainer chips, predicted "
                        f"{m['current_samples_per_s']:.3g} -> {m['predicted_samples_per_s']:.3g}"
                        f" samples/s, payback {m.get('predicted_payback_steps', nan):.3g} "
                        f"steps, pause {m['move_s']:.2f} s")
                if "compile_ahead_s" in m:
                    line += (f", compiled ahead in {m['compile_ahead_s']:.2f} s costing the "
                             f"steps beside it {m['compile_ahead_cost_s']:.2f} s "
                             f"({m['compile_ahead_cache_hits']:.0f} of "
                             f"{m['compile_ahead_compiles']:.0f} executables from the cache)")
                print(line)
                if "measured_cost_s" in m:
                    paused = m["move_s"] + m["recompile_s"]
                    step_s = report["batch"] / m["measured_samples_per_s"]  # the step after
                    print(f"      measured at step {m['at_step']}: "
                          f"{m['measured_samples_per_s']:.3g} samples/s, pause + uncovered "
                          f"compile {m['move_s']:.2f} + {m['recompile_s']:.2f} = {paused:.2f} s"
                          f" = {paused / step_s:.2f} steps' time (goal <= 2), cost "
                          f"{m['measured_cost_s']:.2f} s, payback "
                          f"{m.get('measured_payback_steps', nan):.3g} steps")
            for name in ("before", "after"):
                if name in f:
                    b = f[name]
                    print(f"    {name} the moves (steps {b['steps'][0]}-{b['steps'][-1]}): "
                          f"{b['samples_per_s']:.3g} samples/s, trainer idle "
                          f"{b['trainer_idle']:.1%}, generator {b['produced_per_s']:.3g} "
                          f"samples/s while busy")
    print(f"paired ratios auto / fixed: {', '.join(f'{r:.2f}' for r in report['ratios'])}")
    print(f"auto / fixed throughput: {report['ratio_auto_vs_fixed']:.2f}x")
