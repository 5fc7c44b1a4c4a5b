"""Memory plan of a run: `python launch/memory.py <config.py> [--a.b=c ...] [--budget-gib N]`
(`--help` for the rest; logic in jaxrl/train/memory/cli.py, docs/memory.md)."""

import sys

from jaxrl.train.memory.cli import main

if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
