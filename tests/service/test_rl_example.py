"""examples/tinker_rl.py (an RL loop written only against the tinker SDK) runs end to end; two
steps only: that it learns is measured by running it longer (docs/service.md)."""

from __future__ import annotations

import runpy
from pathlib import Path

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "tinker_rl.py"


def test_rl_example_runs_two_steps(capsys):
    main = runpy.run_path(str(EXAMPLE))["main"]
    assert main(["--steps", "2", "--group", "4", "--max-tokens", "4", "--rank", "4"]) == 0
    out = capsys.readouterr().out
    assert "step   1  reward" in out and "2 steps in" in out, out
