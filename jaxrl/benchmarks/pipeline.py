"""`python launch/bench.py pipeline`: one workload in sync, periodic, async (k=2) and inflight.

Each mode runs the same experiment (default: configs/default.py, SFT warm start from its cache)
for a fixed number of steps with evaluation off. Steps after `--warmup` are averaged: wall-clock
per step, trainer idle fraction, produced vs consumed rollouts/s, weight-sync GB/s. The peer is
`sync` in the same run; each mode's speedup is its step time relative to sync's with the same
`mesh.cpu_cores`, and (last column) relative to the fastest sync of the run.

On a CPU host `--cpu-cores` lists the `mesh.cpu_cores` settings to run every mode under
(jaxrl/cpu.py): by default "shared" (one XLA thread pool: every core for whichever role runs)
and "split" (disjoint cores per role, as two devices would be), so the overlap is shown both
with the roles competing for the same cores and without.
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
import threading
import time
from pathlib import Path

import numpy as np

from jaxrl.config import PIPELINE_MODES as MODES
from jaxrl.config import load_config
from jaxrl.cpu import CPU_CORES, simulated_device_flags, unpin_default_client

COLUMNS = (
    ("pipeline/step_s", "step_s"),
    ("pipeline/trainer_idle_frac", "trainer_idle"),
    ("pipeline/generator_idle_frac", "gen_idle"),
    ("pipeline/rollouts_per_s_produced", "produced/s"),
    ("pipeline/rollouts_per_s_consumed", "consumed/s"),
    ("pipeline/weight_sync_gbps", "sync_GB/s"),
    ("staleness/max", "stale_max"),
    ("reward/mean", "reward"),
)


class HostCpuSampler:
    """Samples the whole host's CPU counters (Linux `/proc/stat`) every `period_s` in a thread,
    so the busy fraction of all cores over any wall-clock window can be read afterwards: it tells
    whether an overlapped mode is bounded by the machine's cores rather than by the schedule.
    Elsewhere (no /proc/stat) `busy_fraction` returns NaN."""

    def __init__(self, period_s: float = 0.1):
        self.samples: list[tuple[float, int, int]] = []  # (epoch s, busy jiffies, all jiffies)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._loop, args=(period_s,), daemon=True,
                                        name="jaxrl-bench-cpu")

    @staticmethod
    def _read() -> tuple[int, int] | None:
        try:
            with open("/proc/stat") as f:
                fields = [int(x) for x in f.readline().split()[1:]]
        except (OSError, ValueError):
            return None
        idle = fields[3] + (fields[4] if len(fields) > 4 else 0)  # idle + iowait
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal
        return total - idle, total

    def _loop(self, period_s: float) -> None:
        while not self._stop.is_set():
            read = self._read()
            if read is None:
                return
            self.samples.append((time.time(), *read))
            self._stop.wait(period_s)

    def __enter__(self):
        self._thread.start()
        return self

    def __exit__(self, *exc):
        self._stop.set()
        self._thread.join()

    def busy_fraction(self, t0: float, t1: float) -> float:
        inside = [s for s in self.samples if t0 <= s[0] <= t1]
        if len(inside) < 2:
            return float("nan")
        (_, b0, a0), (_, b1, a1) = inside[0], inside[-1]
        return (b1 - b0) / max(a1 - a0, 1)


def _parser() -> argparse.ArgumentParser:
    root = Path(__file__).resolve().parents[2]
    p = argparse.ArgumentParser(prog="bench.py pipeline", description=__doc__)
    p.add_argument("--config", default=str(root / "configs" / "default.py"))
    p.add_argument("--steps", type=int, default=12)
    p.add_argument("--warmup", type=int, default=2, help="first steps left out (compilation)")
    p.add_argument("--modes", default=",".join(MODES))
    p.add_argument("--repeats", type=int, default=1,
                   help="run every (cpu_cores, mode) this many times, interleaved, and report "
                        "the median of each figure (a noisy machine drifts between runs)")
    p.add_argument("--cpu-cores", default="shared,split",
                   help="mesh.cpu_cores settings to run the modes under, on a CPU backend "
                        f"(comma-separated; valid: {', '.join(CPU_CORES)})")
    p.add_argument("--out", default=None, help="write the figures as JSON here")
    return p


def main(argv: list[str]) -> int:
    args, overrides = _parser().parse_known_args(argv)
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = simulated_device_flags()
    import jax

    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise SystemExit(f"unknown modes {bad}; valid: {list(MODES)}")
    settings = [c for c in args.cpu_cores.split(",") if c]
    bad = [c for c in settings if c not in CPU_CORES]
    if bad or not settings:
        raise SystemExit(f"unknown --cpu-cores {bad or args.cpu_cores!r}; valid: {list(CPU_CORES)}")
    devices = jax.devices()
    if devices[0].platform != "cpu":
        settings = settings[:1]  # the setting only matters on a CPU backend
    if args.repeats < 1:
        raise SystemExit(f"--repeats must be >= 1, got {args.repeats}")
    results, runs = run(args, overrides, modes, settings)
    print(f"pipeline benchmark: {args.steps} steps per mode ({args.warmup} warm-up left out), "
          f"{len(devices)} {devices[0].platform} device(s), config {Path(args.config).name}"
          + (f", median of {args.repeats} interleaved runs each" if args.repeats > 1 else ""))
    print(f"{'cpu_cores':<10}{'mode':<9}" + "".join(f"{label:>13}" for _, label in COLUMNS)
          + f"{'host_cpu':>10}{'vs sync':>9}{'vs best sync':>14}")
    syncs = [f["step_s"] for (_, m), f in results.items() if m == "sync"]
    best = min(syncs) if syncs else None
    for (cores, mode), f in results.items():
        base = results.get((cores, "sync"), {}).get("step_s")
        speed = f"{base / f['step_s']:.2f}x" if base else "-"
        vs_best = f"{best / f['step_s']:.2f}x" if best else "-"
        print(f"{cores:<10}{mode:<9}" + "".join(f"{f[label]:>13.4g}" for _, label in COLUMNS)
              + f"{f['host_cpu_busy']:>10.0%}{speed:>9}{vs_best:>14}")
    print(f"host_cpu: busy fraction of all {os.cpu_count()} host cores over the timed steps "
          "(trainer, generator and sandbox workers together, plus anything else on the machine)")
    if args.repeats > 1:
        each = (f"{c}/{m} " + " ".join(f"{f['step_s']:.3f}" for f in fs)
                for (c, m), fs in runs.items())
        print("step_s of each run: " + "; ".join(each))
    if args.out:
        Path(args.out).write_text(json.dumps(
            {f"{cores}/{mode}": {"median": results[cores, mode], "runs": fs}
             for (cores, mode), fs in runs.items()}, indent=1))
    return 0


def run(args, overrides: list[str], modes: list[str], settings: list[str]
        ) -> tuple[dict[tuple[str, str], dict], dict[tuple[str, str], list[dict]]]:
    """(median figures, every run's figures) per (cpu_cores, mode), the runs interleaved."""
    runs: dict[tuple[str, str], list[dict]] = {}
    with tempfile.TemporaryDirectory(prefix="jaxrl-bench-") as tmp:
        try:
            for r in range(args.repeats):
                for cores in settings:
                    for mode in modes:
                        runs.setdefault((cores, mode), []).append(
                            _run_mode(args, overrides, tmp, mode, cores, tag=str(r)))
        finally:
            unpin_default_client()  # a split run pins this process's XLA threads
    results = {key: {k: float(np.median([f[k] for f in fs])) for k in fs[0]}
               for key, fs in runs.items()}
    return results, runs


def _run_mode(args, overrides: list[str], tmp: str, mode: str, cores: str, tag: str) -> dict:
    from jaxrl.run import run

    cfg = load_config(args.config, [
        *overrides, f"--name=bench-{cores}-{mode}-{tag}", f"--run_dir={tmp}",
        f"--pipeline.mode={mode}", "--pipeline.max_staleness=2", f"--mesh.cpu_cores={cores}",
        f"--pipeline.steps={args.steps}", "--train.checkpoint_every=0",
    ])
    t0 = time.perf_counter()
    with HostCpuSampler() as cpu:
        result = run(cfg, progress=False, evaluate=False)
    rows = result.history[args.warmup:]
    figures = {label: float(np.mean([r[key] for r in rows if key in r])) for key, label in COLUMNS}
    # the timed steps span from the end of the last warm-up step to the end of the run
    start = result.history[args.warmup - 1]["time"] if args.warmup else rows[0]["time"]
    figures["host_cpu_busy"] = cpu.busy_fraction(start, rows[-1]["time"])
    figures["wall_s"] = time.perf_counter() - t0
    return figures
