"""Benchmarks: `python launch/bench.py <name> [options]`; `--help` after a name lists its options.

Each benchmark compares against a named peer in the same run and prints ratios; figures and the
exact commands are recorded in docs/benchmarks.md.
"""

import importlib
import sys

BENCHMARKS = {
    "generate": "jaxrl.benchmarks.generate",
    "train": "jaxrl.benchmarks.train",
    "sandbox": "jaxrl.benchmarks.sandbox",
    "reshard": "jaxrl.benchmarks.reshard",
    "pipeline": "jaxrl.benchmarks.pipeline",
    "kernels": "jaxrl.benchmarks.kernels",
    "math": "jaxrl.benchmarks.math",
    "agentic": "jaxrl.benchmarks.agentic",
    "service": "jaxrl.benchmarks.service",
    "suite": "jaxrl.benchmarks.suite",
    "rl-step": "jaxrl.benchmarks.rl_step",
    "rebalance": "jaxrl.benchmarks.rebalance",
    "disaggregated": "jaxrl.benchmarks.disaggregated",
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        got = argv[0] if argv else "nothing"
        print(f"usage: bench.py {{{'|'.join(BENCHMARKS)}}} [options]; got {got!r}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]])  # each exists (tests/test_benchmarks)
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
