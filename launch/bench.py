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
}


def main(argv: list[str]) -> int:
    if not argv or argv[0] not in BENCHMARKS:
        got = argv[0] if argv else "nothing"
        print(f"usage: bench.py {{{'|'.join(BENCHMARKS)}}} [options]; got {got!r}", file=sys.stderr)
        return 2
    try:
        module = importlib.import_module(BENCHMARKS[argv[0]])
    except ModuleNotFoundError as e:
        if e.name == BENCHMARKS[argv[0]]:
            print(f"benchmark {argv[0]!r} is not implemented yet", file=sys.stderr)
            return 2
        raise
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
