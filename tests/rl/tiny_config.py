"""The tiny run of tests/rl/run_helpers.py as an experiment file (for subprocess runs)."""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_helpers import tiny_run_config  # noqa: E402


def config():
    return tiny_run_config(Path("."), name="tiny")
