"""Sandbox pool benchmark: `python launch/bench.py sandbox [--jobs N] [--workers W] [--tier T]`.

Runs a small Python program on the warm pool with W concurrent callers (closed loop: each caller
sends one job, waits for its result, sends the next), then the same program with the same
concurrency as a fresh `python3` process per execution (the peer). Prints executions/s (total and
per worker), p50/p99 round-trip latency, p50 start latency (dispatch to the job's code running),
and the warm/fresh ratio.
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import threading
import time

from jaxrl.rewards.pool import TIERS, LocalSandboxPool, _pct
from jaxrl.rewards.types import SandboxJob

PROGRAM = "import sys\nn = int(sys.stdin.read())\nprint(sum(i * i for i in range(n)))\n"
STDIN, EXPECTED = "1000", f"{sum(i * i for i in range(1000))}\n"


def _closed_loop(run_one, jobs: int, workers: int) -> tuple[float, list[float], list]:
    """`workers` threads call `run_one()` until `jobs` calls are done.

    Returns (seconds, per-call latencies, per-call return values)."""
    lat, extra, lock = [], [], threading.Lock()
    left = [jobs]

    def caller():
        while True:
            with lock:
                if left[0] == 0:
                    return
                left[0] -= 1
            t = time.perf_counter()
            out = run_one()
            dt = time.perf_counter() - t
            with lock:
                lat.append(dt)
                extra.append(out)

    threads = [threading.Thread(target=caller) for _ in range(workers)]
    t0 = time.perf_counter()
    for th in threads:
        th.start()
    for th in threads:
        th.join()
    return time.perf_counter() - t0, lat, extra


def _fmt(name: str, seconds: float, lat: list[float], n: int, workers: int, cpu_s: float) -> str:
    return (f"{name:<14} {n / seconds:8.1f} exec/s  {n / seconds / workers:7.1f} exec/s/worker  "
            f"{n / cpu_s:7.1f} exec per CPU-s  "
            f"p50 {_pct(lat, 0.5) * 1e3:7.2f} ms  p99 {_pct(lat, 0.99) * 1e3:7.2f} ms")


def _cpu_s(pids: list[int] = ()) -> float:
    """CPU seconds of this process, its reaped children, and `pids` with their reaped children."""
    total = 0.0
    for who in (resource.RUSAGE_SELF, resource.RUSAGE_CHILDREN):
        ru = resource.getrusage(who)
        total += ru.ru_utime + ru.ru_stime
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        total += sum(int(x) for x in fields[11:15]) / tick  # utime stime cutime cstime
    return total


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.py sandbox", description=__doc__.split("\n\n")[1])
    ap.add_argument("--jobs", type=int, default=2000, help="executions on the warm pool")
    ap.add_argument("--baseline-jobs", type=int, default=100, help="fresh-python3 executions")
    ap.add_argument("--workers", type=int, default=None, help="default: one per CPU core")
    ap.add_argument("--tier", default="auto", choices=TIERS)
    args = ap.parse_args(argv)
    workers = args.workers or len(os.sched_getaffinity(0))
    if args.jobs < 1 or args.baseline_jobs < 1 or workers < 1:
        ap.error(f"--jobs, --baseline-jobs and --workers must be >= 1, got {args.jobs}, "
                 f"{args.baseline_jobs}, {workers}")
    job = SandboxJob(code=PROGRAM, stdin=STDIN, timeout_s=10)
    with LocalSandboxPool(num_workers=workers, tier=args.tier) as pool:
        pool.run([job] * (4 * workers))  # warm-up
        zygotes = [s.zygote_pids()[-1] for s in pool._slots]
        cpu0 = _cpu_s(zygotes)
        secs, lat, results = _closed_loop(lambda: pool.run([job])[0], args.jobs, workers)
        cpu = _cpu_s(zygotes) - cpu0
        bad = [r for r in results if r.status != "ok" or r.stdout != EXPECTED]
        if bad:
            print(f"sandbox bench: {len(bad)} wrong results, first: {bad[0]}", file=sys.stderr)
            return 1
        start = [r.start_s for r in results]
        print(f"sandbox bench: {workers} workers, {os.cpu_count()} CPUs, {pool.tier_detail}")
        print(_fmt("warm pool", secs, lat, args.jobs, workers, cpu)
              + f"  start p50 {_pct(start, 0.5) * 1e3:.2f} ms p99 {_pct(start, 0.99) * 1e3:.2f} ms")

    def fresh():
        p = subprocess.run([sys.executable, "-c", PROGRAM], input=STDIN, capture_output=True,
                           text=True, timeout=30)
        return p.stdout == EXPECTED

    cpu0 = _cpu_s()
    b_secs, b_lat, b_ok = _closed_loop(fresh, args.baseline_jobs, workers)
    b_cpu = _cpu_s() - cpu0
    if not all(b_ok):
        print("sandbox bench: the fresh-python3 baseline gave wrong results", file=sys.stderr)
        return 1
    print(_fmt("fresh python3", b_secs, b_lat, args.baseline_jobs, workers, b_cpu))
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} (on a shared machine, exec per CPU-s is the steadier figure)")
    ratio = (args.jobs / secs) / (args.baseline_jobs / b_secs)
    print(f"ratio warm/fresh: {ratio:.1f}x executions/s, "
          f"{_pct(b_lat, 0.5) / _pct(lat, 0.5):.1f}x lower p50 latency")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
