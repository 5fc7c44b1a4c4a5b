"""Math answer checkers on one hand-labelled set: `python launch/bench.py math [--timeout-s T]`.

Scores every row of `math_answer_set.ANSWER_SET` with each backend of `math_answer.math_score`
("sympy", the hand-written checker; "math_verify", Hugging Face's `math-verify`, and "auto",
the first with the second for answers outside its grammar, when math-verify is installed), each
call in a killable worker with the same deadline (a timeout or crash counts as a 0 score, as in
training). `--set held_out` uses the rows written after the hand-written checker was frozen.
Prints accuracy (overall, per kind), false positives (a wrong answer scored 1; how many of them on
the hostile rows), time per check measured inside the worker (mean, p99; calls that timed out or
crashed are counted apart and listed), and the rows each backend gets wrong.
"""

from __future__ import annotations

import argparse
import collections
import time

from jaxrl.benchmarks.math_answer_set import ANSWER_SET, HELD_OUT
from jaxrl.rewards.math import answer as ma
from jaxrl.sandbox.workers import KillableWorkers


def _timed(completion: str, gold: str, backend: str) -> tuple[float, float]:
    t = time.perf_counter()
    score = ma.math_score(completion, gold, backend=backend)
    return score, time.perf_counter() - t


def run_backend(backend: str, rows: list, timeout_s: float, workers: KillableWorkers) -> dict:
    args = [(c, g, backend) for c, g, _, _ in rows]
    workers.map(_timed, args[:3], timeout_s=60)  # warm: imports and first-use caches
    t0 = time.perf_counter()
    outs = workers.map(_timed, args, timeout_s=timeout_s)
    wall = time.perf_counter() - t0
    right, per_kind, wrong, times, failed = 0, collections.Counter(), [], [], 0
    totals = collections.Counter(k for *_, k in rows)
    for (c, g, expected, kind), out in zip(rows, outs, strict=True):
        if isinstance(out, Exception):
            failed += 1
            print(f"  {backend}: {type(out).__name__} on {c[-50:]!r} vs gold {g!r}")
            verdict = False  # scored 0; its time (the deadline) is left out of the time figures
        else:
            verdict = out[0] == 1.0
            times.append(out[1])
        if verdict == expected:
            right += 1
            per_kind[kind] += 1
        else:
            wrong.append((kind, expected, c[-60:], g, type(out).__name__))
    times.sort()
    return dict(
        backend=backend,
        accuracy=right / len(rows),
        false_positives=sum(1 for w in wrong if not w[1]),
        per_kind={k: f"{per_kind[k]}/{n}" for k, n in totals.items()},
        hostile_false_positives=sum(1 for w in wrong if w[0] == "hostile" and not w[1]),
        failed=failed,
        mean_ms=1e3 * sum(times) / len(times),
        p99_ms=1e3 * times[int(0.99 * (len(times) - 1))],
        wall_s=wall,
        wrong=wrong,
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench.py math", description=__doc__)
    p.add_argument("--timeout-s", type=float, default=5.0, help="deadline per check")
    p.add_argument(
        "--set",
        choices=("tuned", "held_out"),
        default="tuned",
        help="tuned: ANSWER_SET (the hand-written checker was corrected against it); "
        "held_out: HELD_OUT (written after it was frozen)",
    )
    args = p.parse_args(argv)
    backends = ["sympy"]
    try:
        import math_verify  # noqa: F401

        backends += ["math_verify", "auto"]
    except ImportError:
        print("math-verify is not installed: only the hand-written backend is measured")
    rows = ANSWER_SET if args.set == "tuned" else HELD_OUT
    print(
        f"set {args.set}: {len(rows)} hand-labelled rows, deadline {args.timeout_s:g} s per check"
    )
    with KillableWorkers(1, preload=("sympy", "math_verify")) as workers:
        for backend in backends:
            r = run_backend(backend, rows, args.timeout_s, workers)
            print(
                f"\n{backend}: accuracy {r['accuracy']:.3f}, false positives {r['false_positives']}"
                f" "
                f"({r['hostile_false_positives']} hostile), timeouts/crashes {r['failed']}, "
                f"{r['mean_ms']:.1f} ms/check mean, p99 {r['p99_ms']:.1f} ms, "
                f"wall {r['wall_s']:.1f} s"
            )
            print("  per kind:", ", ".join(f"{k} {v}" for k, v in r["per_kind"].items()))
            for kind, expected, c, g, err in r["wrong"]:
                print(f"  wrong [{kind}] expected {expected}: {c!r} vs gold {g!r} ({err})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
