"""Acceptance (issue 48): tinker-cookbook 0.6.1's `rl_loop` and `math_rl` (gsm8k), unchanged,
with their default loss `stable_reinforce`, against `launch/serve.py`, offline on the cache of
examples/cookbook_offline_cache.py whose model is made a bigram model that writes
`\\boxed{<random digit>}` (tests/service/cookbook_bigram.py), so rewards vary within a group and
each step trains (a non-zero gradient norm in the recipe's own metrics).

The recipes run in the cookbook's environment (docs/service.md, "tinker-cookbook": `pip install
--no-deps tinker-cookbook==0.6.1` plus its listed dependencies but `tml-renderers`): this
interpreter if it imports `tinker_cookbook`, else `$JAXRL_COOKBOOK_PYTHON`; without either the
test is skipped, saying so."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.2-1B"


def _load(path: Path):
    spec = importlib.util.spec_from_file_location(path.stem, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _cookbook_python() -> str | None:
    if importlib.util.find_spec("tinker_cookbook") is not None:
        return sys.executable
    return os.environ.get("JAXRL_COOKBOOK_PYTHON")


PYTHON = _cookbook_python()
# .ci/cookbook.sh (run by .ci/run) sets JAXRL_COOKBOOK_REQUIRED: there a missing cookbook fails
if PYTHON is None and os.environ.get("JAXRL_COOKBOOK_REQUIRED"):
    raise RuntimeError("JAXRL_COOKBOOK_REQUIRED is set but tinker-cookbook does not import here "
                       "and JAXRL_COOKBOOK_PYTHON is not set")
pytestmark = [pytest.mark.slow, pytest.mark.skipif(
    PYTHON is None, reason="tinker-cookbook 0.6.1 is not installed here and "
    "JAXRL_COOKBOOK_PYTHON is not set (docs/service.md, 'tinker-cookbook'); CI runs it in "
    ".ci/cookbook.sh")]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    cache = _load(ROOT / "examples" / "cookbook_offline_cache.py")
    hf = tmp_path_factory.mktemp("hf")
    cache.write_tokenizer(cache.snapshot(hf, cache.TOKENIZER_REPO))
    model_dir = cache.snapshot(hf, cache.MODEL_REPO)
    cache.write_tokenizer(model_dir)
    cache.write_model(model_dir, vocab_size=512)
    _load(Path(__file__).with_name("cookbook_bigram.py")).make_bigram(model_dir)
    cache.write_dataset(hf, cache.GSM8K_REPO, "main", cache.gsm8k_rows,
                        (("train", 32), ("test", 8)))
    env = {**os.environ, "HF_HOME": str(hf), "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TINKER_API_KEY": "tml-local"}
    log = open(hf / "serve.log", "w+")  # noqa: SIM115 - closed at teardown
    server = subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "serve.py"), "--base-model", MODEL, "--port", "0",
         "--state-dir", str(hf / "state")], env=env, stdout=subprocess.PIPE, stderr=log,
        text=True)
    line = server.stdout.readline()
    assert line.startswith("jaxrl service: "), (line, (hf / "serve.log").read_text())
    yield line.split()[-1], env, hf
    server.terminate()
    server.wait(30)
    log.close()


def _recipe(served, module: str, *args: str) -> list[dict]:
    url, env, hf = served
    out = hf / module.rsplit(".", 2)[-2 if module.endswith(".train") else -1]
    proc = subprocess.run(
        [PYTHON, "-m", module, f"base_url={url}", f"model_name={MODEL}", f"log_path={out}",
         *args], env=env, cwd=hf, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "BadRequestError" not in proc.stderr, proc.stderr[-4000:]
    return [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_rl_loop_trains_with_stable_reinforce(served):
    rows = _recipe(served, "tinker_cookbook.recipes.rl_loop", "batch_size=4", "group_size=8",
                   "max_tokens=32", "max_steps=1")
    assert rows[0]["progress/batch"] == 0 and 0 < rows[0]["reward/total"] < 1, rows
    assert rows[0]["grad_norm:mean"] > 0, rows  # trained: a group's rewards differed


def test_math_rl_trains_with_stable_reinforce(served):
    rows = _recipe(served, "tinker_cookbook.recipes.math_rl.train", "env=gsm8k",
                   "group_size=4", "groups_per_batch=4", "max_tokens=32", "max_steps=1",
                   "behavior_if_log_dir_exists=delete")
    assert rows[0]["grad_norm:mean"] > 0, rows
    rewards = [r["env/all/reward/total"] for r in rows if "env/all/reward/total" in r]
    assert rewards, rows
