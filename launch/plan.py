"""Throughput planner: `python launch/plan.py --help` (logic in jaxrl/planner/cli.py)."""

import sys

from jaxrl.planner.cli import main

if __name__ == "__main__":
    sys.exit(main())
