"""The quick start's examples run as written (docs/quickstart.md)."""

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _example(name: str) -> str:
    text = (ROOT / "docs" / "quickstart.md").read_text()
    m = re.search(rf"<!-- example: {name} -->\s*```python\n(.+?)```", text, re.S)
    assert m, f"docs/quickstart.md has no example {name!r}"
    return m.group(1)


@pytest.mark.slow
def test_custom_reward_example_runs_end_to_end(tmp_path):
    """A tiny run whose reward is a ten-line Python function, exactly as the docs show it."""
    (tmp_path / "example.py").write_text(_example("custom-reward"))
    out = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True,
                         text=True, timeout=900,
                         env={**os.environ, "PYTHONPATH": str(ROOT), "XLA_FLAGS": ""})
    assert out.returncode == 0, out.stderr[-3000:]
    last = out.stdout.strip().splitlines()[-1]
    assert re.fullmatch(r"[0-9.]+ -> [0-9.]+", last), last
    rows = [json.loads(r) for r in
            (tmp_path / "runs" / "sums" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert all(0.0 <= r["reward/mean"] <= 1.0 for r in rows)
