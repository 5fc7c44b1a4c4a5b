"""Acceptance (issue 48): tinker-cookbook 0.6.1's recipes, unchanged, against `launch/serve.py`,
offline on the cache of examples/cookbook_offline_cache.py whose model is made a bigram model
that writes `\\boxed{<random digit>}` (tests/service/cookbook_bigram.py), so rewards vary within a
group and each RL step trains (a non-zero gradient norm in the recipe's own metrics):

- `rl_loop` and `math_rl` (gsm8k, sync) with their default loss `stable_reinforce`;
- `rl_loop` with `loss_fn=gspo`; `math_rl` with `loss_fn=dro` (`rl_loop`'s own command line
  refuses `dro`: its `loss_fn` is a `Literal` without it, docs/service.md);
- `math_rl` async (`max_steps_off_policy=1`) with its default loss;
- `math_rl` from `load_checkpoint_path` (the sync run's final state) with no warning from the
  cookbook's checkpoint / renderer lookup (`get_training_run_by_tinker_path`);
- `chat_sl` with rolling checkpoints (`rolling_save_every=1`): the superseded ones' files leave
  the server's `--state-dir`, the final one's stay.

Every run also checks that the server refused or failed no request (its log's warning lines).

The recipes run in the cookbook's environment (docs/service.md, "tinker-cookbook": `pip install
--no-deps tinker-cookbook==0.6.1` plus its listed dependencies but `tml-renderers`): this
interpreter if it imports `tinker_cookbook`, else `$JAXRL_COOKBOOK_PYTHON`; without either the
test is skipped, saying so."""

from __future__ import annotations

import importlib.util
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

ROOT = Path(__file__).resolve().parents[2]
MODEL = "meta-llama/Llama-3.2-1B"
MATH_RL = "tinker_cookbook.recipes.math_rl.train"
# math_rl on gsm8k, small; eval off but where a test keeps the recipe's default
MATH_ARGS = ("env=gsm8k", "group_size=4", "groups_per_batch=4", "max_tokens=32",
             "behavior_if_log_dir_exists=delete")


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
    cache.write_dataset(hf, cache.GSM8K_REPO, "main", lambda n, split: [  # the bigram's digits
        r for r in cache.gsm8k_rows(16 * n, split) if r["answer"][-1] in "23"][:n],
        (("train", 32), ("test", 8)))
    cache.write_dataset(hf)  # no_robots, for chat_sl
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


class Run:
    """One recipe run: its metrics rows, its stderr (the cookbook logs there) and log dir."""

    def __init__(self, rows: list[dict], stderr: str, out: Path):
        self.rows, self.stderr, self.out = rows, stderr, out

    def trained(self) -> list[float]:
        return [r["grad_norm:mean"] for r in self.rows if "grad_norm:mean" in r]

    def checkpoints(self) -> list[dict]:
        return [json.loads(x) for x in (self.out / "checkpoints.jsonl").read_text().splitlines()]


def _recipe(served, name: str, module: str, *args: str) -> Run:
    url, env, hf = served
    out = hf / "runs" / name
    server_log = hf / "serve.log"
    seen = server_log.stat().st_size
    proc = subprocess.run(
        [PYTHON, "-m", module, f"base_url={url}", f"model_name={MODEL}", f"log_path={out}",
         *args], env=env, cwd=hf, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "BadRequestError" not in proc.stderr, proc.stderr[-4000:]
    with open(server_log) as f:  # the server's log lines for this run: none refused or failed
        f.seek(seen)
        bad = [x for x in f.read().splitlines() if re.search(r"\b(refused|failed)\b", x)]
    assert not bad, bad
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    return Run(rows, proc.stderr, out)


@pytest.fixture(scope="module")
def math_rl_sync(served) -> Run:
    """math_rl with its defaults (stable_reinforce, eval and save on): the resume test's source."""
    return _recipe(served, "math_rl", MATH_RL, *MATH_ARGS, "max_steps=1")


def test_rl_loop_trains_with_stable_reinforce(served):
    run = _recipe(served, "rl_loop", "tinker_cookbook.recipes.rl_loop", "batch_size=4",
                  "group_size=8", "max_tokens=32", "max_steps=1")
    assert run.rows[0]["progress/batch"] == 0 and 0 < run.rows[0]["reward/total"] < 1, run.rows
    assert run.rows[0]["grad_norm:mean"] > 0, run.rows  # trained: a group's rewards differed


def test_rl_loop_trains_with_gspo(served):
    run = _recipe(served, "rl_loop_gspo", "tinker_cookbook.recipes.rl_loop", "batch_size=4",
                  "group_size=8", "max_tokens=32", "max_steps=1", "loss_fn=gspo")
    assert run.rows[0]["grad_norm:mean"] > 0, run.rows


def test_math_rl_trains_with_stable_reinforce(math_rl_sync):
    assert math_rl_sync.trained() and math_rl_sync.trained()[0] > 0, math_rl_sync.rows
    rewards = [r["env/all/reward/total"] for r in math_rl_sync.rows
               if "env/all/reward/total" in r]
    assert rewards, math_rl_sync.rows


def test_math_rl_trains_with_dro(served):
    run = _recipe(served, "math_rl_dro", MATH_RL, *MATH_ARGS, "max_steps=1", "eval_every=0",
                  "loss_fn=dro")
    config = json.loads((run.out / "config.json").read_text())  # the recipe's resolved config
    assert config["loss_fn"] == "dro", config
    # trained, and not by the penalty on the prompt positions the cookbook sends with q = 0 and
    # A = 0 (unmasked, their (log p)^2 gave a gradient norm of 1.5e5 here; the other losses
    # 0.2-1.4)
    assert run.trained() and 0 < run.trained()[0] < 100, run.rows


def test_math_rl_async_one_step_off_policy_trains(served):
    run = _recipe(served, "math_rl_async", MATH_RL, *MATH_ARGS, "max_steps=2", "eval_every=0",
                  "max_steps_off_policy=1")
    steps = [r for r in run.rows if "grad_norm:mean" in r]
    assert len(steps) == 2 and all(r["grad_norm:mean"] > 0 for r in steps), run.rows
    # the async loop's own metric: how many steps old the weights that sampled a batch were
    assert all("async/staleness_max" in r and r["async/staleness_max"] <= 1 for r in steps), steps


def test_math_rl_resumes_from_load_checkpoint_path_without_warnings(served, math_rl_sync):
    path = math_rl_sync.checkpoints()[-1]["state_path"]
    assert path.startswith("tinker://"), path
    run = _recipe(served, "math_rl_resume", MATH_RL, *MATH_ARGS, "max_steps=1", "eval_every=0",
                  f"load_checkpoint_path={path}")
    # the renderer came from the checkpoint's training run (get_training_run_by_tinker_path)
    assert f"Renderer metadata matches for checkpoint {path}: role_colon" in run.stderr
    assert f"Loaded weights from {path}" in run.stderr
    # no warning about the checkpoint or its renderer ("Could not fetch renderer metadata",
    # "Renderer mismatch"); the SDK's FutureWarning on the cookbook's create_rest_client() call
    # is about the cookbook's code, not the lookup's outcome
    warned = [x for x in run.stderr.splitlines() if re.search("warn", x, re.I)
              and re.search("checkpoint|renderer", x, re.I)
              and "create_rest_client() is deprecated" not in x]
    assert not warned, warned
    assert run.trained() and run.trained()[0] > 0, run.rows


def test_sl_loop_trains(served):
    run = _recipe(served, "sl_loop", "tinker_cookbook.recipes.sl_loop", "batch_size=8",
                  "max_steps=2", "max_length=512", "save_every=0")
    losses = [r["train_mean_nll"] for r in run.rows if "train_mean_nll" in r]
    assert len(losses) == 2 and all(np.isfinite(losses)), run.rows


def test_chat_sl_rolling_checkpoints_leave_the_state_dir(served):
    run = _recipe(served, "chat_sl_rolling", "tinker_cookbook.recipes.chat_sl.train",
                  "batch_size=8", "max_steps=3", "max_length=512", "rolling_save_every=1",
                  "save_every=0", "eval_every=0", "infrequent_eval_every=0",
                  "behavior_if_log_dir_exists=delete")
    records = run.checkpoints()
    rolling = [r["state_path"] for r in records if r.get("rolling")]
    final = [r["state_path"] for r in records if r["name"] == "final"]
    assert len(rolling) == 2 and len(final) == 1, records

    def files(tinker_path: str) -> list[Path]:  # tinker://<run>/weights/<name> on disk
        run_id, kind, name = tinker_path.removeprefix("tinker://").split("/")
        return sorted((served[2] / "state" / "weights" / run_id / kind).glob(f"{name}.*"))

    for path in rolling:
        assert f"Deleted rolling checkpoint {path}" in run.stderr, run.stderr[-4000:]
        assert files(path) == [], path
    assert files(final[0]), (final, sorted((served[2] / "state").rglob("*")))
    assert "Failed to delete" not in run.stderr
