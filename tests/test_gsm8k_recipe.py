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


def test_the_recipe_needs_neither_torch_nor_transformers(tmp_path):
    """docs/quickstart.md's setup check runs after a plain `pip install -e .`: the recipe is
    written with torch and `transformers` unimportable, and `transformers` loads what it wrote."""
    script = ("import sys; sys.modules['torch'] = None; sys.modules['transformers'] = None\n"
              "from jaxrl.testing import make_gsm8k_recipe; make_gsm8k_recipe(sys.argv[1])")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    made = subprocess.run([sys.executable, "-c", script, str(tmp_path / "recipe")], env=env,
                          capture_output=True, text=True, timeout=300)
    assert made.returncode == 0, made.stderr[-2000:]
    import transformers

    model_dir = tmp_path / "recipe" / "model"
    hf, info = transformers.AutoModelForCausalLM.from_pretrained(model_dir,
                                                                 output_loading_info=True)
    assert type(hf).__name__ == "Qwen2ForCausalLM"
    assert not any(info.values()), info  # no missing, unexpected or mismatched tensors
    tok = transformers.AutoTokenizer.from_pretrained(model_dir)
    assert tok.eos_token == "<|im_end|>" and len(tok) <= hf.config.vocab_size
    rows = (tmp_path / "recipe" / "train.jsonl").read_text().splitlines()
    assert len(rows) == 48 and "####" in json.loads(rows[0])["answer"]


def test_the_recipe_command_answers_help_and_misuse():
    run = [sys.executable, "-m", "jaxrl.testing"]
    out = subprocess.run(run + ["--help"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "gsm8k-recipe OUT_DIR" in out.stdout, out
    out = subprocess.run(run + ["recipe"], capture_output=True, text=True, timeout=60)
    assert out.returncode == 1 and "usage: python -m jaxrl.testing" in out.stderr, out
