"""The GSM8K recipe at toy size finishes (configs/gsm8k_tiny.py, data and model from
`python -m jaxrl.testing gsm8k-recipe`)."""

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.slow
def test_gsm8k_tiny_recipe_completes(tmp_path):
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    made = subprocess.run([sys.executable, "-m", "jaxrl.testing", "gsm8k-recipe",
                           "runs/gsm8k-tiny"], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "run.py"), "--quiet",
                          "--config", str(ROOT / "configs" / "gsm8k_tiny.py")], cwd=tmp_path,
                         env=env, capture_output=True, text=True, timeout=900)
    assert run.returncode == 0, (run.stdout + run.stderr)[-3000:]
    run_dir = tmp_path / "runs" / "gsm8k_tiny"
    rows = [json.loads(r) for r in (run_dir / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert "eval/pass@1" in rows[-1] and (run_dir / "checkpoints" / "5").is_dir()
