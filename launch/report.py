"""Benchmark reports: `python launch/report.py A.json B.json ... [--out DIR]` puts suite results
side by side; `python launch/report.py --page [--check]` writes docs/benchmarks.md from the result
files (results/ and docs/bench_results/ of this repository).

See jaxrl/benchmarks/report.py.
"""

import sys
from pathlib import Path

from jaxrl.benchmarks.report import main

ROOT = Path(__file__).resolve().parents[1]

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:], root=ROOT))
