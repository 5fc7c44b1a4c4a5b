"""Runs that stop and resume: SIGKILL (the newest checkpoint survives) and SIGTERM / SIGINT (a
checkpoint at the last finished step within `preemption_grace_s`), then `--resume` continues
exactly as the uninterrupted run did, in `periodic` mode (the default), full-parameter and LoRA
(the LoRA run on a tiny Gemma 3 by `--init`, past its sliding window, then exported merged and as
a PEFT adapter).

One reference run is shared by the SIGKILL and SIGTERM victims (each with its own
checkpoint_every; the results do not depend on it). The SIGTERM test also holds what
test_sigterm.py checked: exit 143 with the line saying to --resume, nothing of the run left
running, every metrics row once after the resume (a row written between two checkpoints used to
be lost). The other modes' resume is shown at the loop (test_resume_in_flight.py)."""

import os
import re
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest
from fake_loop import batch, fake_loop
from run_helpers import has_sealed_checkpoint

sys.path.insert(0, str(Path(__file__).parents[1] / "models"))  # the tiny windowed HF models
from windowed_models import WINDOW, make_windowed_hf  # noqa: E402

from jaxrl.rl.metrics import read_metrics  # noqa: E402
from jaxrl.rl.stopping import Stopping, Terminated  # noqa: E402
from jaxrl.train.run_dir import run_config as read_run_config  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]

# The tiny run, its steps slowed by an in-process reward that sleeps (so a signal lands mid-step,
# ~0.3 s a step) and scores each completion by its characters: rewards vary within a group, so
# the policy learns every step and a batch made from another version has other rewards (the
# task's own reward is 0 for the tiny model: with it alone, nothing would differ).
CONFIG = """
import dataclasses, sys, time
from pathlib import Path
sys.path.insert(0, {helpers!r})
from run_helpers import tiny_run_config


def config():
    from jaxrl.data import tasks
    from jaxrl.rewards.rewards import register_reward

    @register_reward("test_slow_varied", overwrite=True, isolated=False)
    def slow_varied(prompt, completion, **fields):
        time.sleep(0.02)
        return (sum(map(ord, completion)) % 5) / 4

    real = tasks.build_task
    tasks.build_task = lambda cfg: dataclasses.replace(
        real(cfg), rewards={{**real(cfg).rewards, "test_slow_varied": 0.5}})
    return tiny_run_config(Path("."), name="slow")
"""


def _launch(root, name, *extra):
    config = root / "slow_config.py"
    config.write_text(CONFIG.format(helpers=str(Path(__file__).parent)))
    env = dict(os.environ, JAXRL_CPU_DEVICES="2", PYTHONPATH=str(ROOT))
    env.pop("XLA_FLAGS", None)
    return subprocess.Popen(
        [sys.executable, str(ROOT / "launch" / "run.py"), "--quiet", "--config", str(config),
         f"--run_dir={root / 'runs'}", f"--name={name}",
         f"--data.sft.cache_dir={root / 'cache'}", "--pipeline.mode=periodic", *extra],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=root,
        start_new_session=True)


STEPS = ["--pipeline.steps=8"]  # periodic (the default mode), as every run of this module
KEYS = ("data/prompts_consumed", "reward/mean", "loss/total", "train/grad_norm")


@pytest.fixture(scope="module")
def reference(tmp_path_factory):
    """The uninterrupted run every victim of this module is compared with (its own
    checkpoint_every: a result must not depend on it)."""
    root = tmp_path_factory.mktemp("preemption")
    ref = _launch(root, "ref", *STEPS, "--train.checkpoint_every=4")
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out[-3000:]
    return root


def _final_params(run_dir):
    import jax
    import orbax.checkpoint as ocp

    step = max(int(p.name) for p in (run_dir / "checkpoints").iterdir() if p.name.isdigit())
    raw = ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")
    return [np.asarray(x) for x in jax.tree.leaves(raw["params"])]


def _assert_continues_exactly(run_dir, ref_dir, steps):
    rows, ref_rows = read_metrics(run_dir), read_metrics(ref_dir)
    assert all(r["train/grad_norm"] > 0 for r in ref_rows)  # it learns: versions differ
    assert [r["step"] for r in rows] == list(range(steps))  # each step once, continuing
    assert [r["step"] for r in ref_rows] == list(range(steps))
    for key in KEYS:
        assert [r[key] for r in rows] == [r[key] for r in ref_rows], key
    for x, y in zip(_final_params(run_dir), _final_params(ref_dir), strict=True):
        np.testing.assert_array_equal(x, y)


def _kill_after(victim, run_dir, rows):
    """SIGKILL once `rows` rows are logged and a checkpoint is on disk."""
    metrics = run_dir / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= rows
               and has_sealed_checkpoint(run_dir)):
        if victim.poll() is not None or time.time() > deadline:
            pytest.fail("the run ended before it could be killed:\n"
                        + victim.communicate()[0][-3000:])
        time.sleep(0.05)
    victim.send_signal(signal.SIGKILL)
    victim.wait()


@pytest.mark.slow
def test_sigkill_then_resume_continues_exactly(reference):
    """Periodic mode, killed after step 4 or later with the checkpoint after 3 steps on disk:
    the resumed run trains on the batch in flight at its checkpoint as the victim made it (from
    the version before) and matches the uninterrupted run in every row and parameter (that
    batch used to be generated again from the checkpoint's version: other rewards, issue 47)."""
    victim = _launch(reference, "killed", *STEPS, "--train.checkpoint_every=3")
    _kill_after(victim, reference / "runs" / "killed", rows=5)
    resumed = _launch(reference, "killed", *STEPS, "--train.checkpoint_every=3", "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    found = re.search(r"resumed killed from its checkpoint at step (\d+)", out)
    assert found and int(found.group(1)) in (3, 6), out[-3000:]
    assert "trained as made, not generated again" in out
    _assert_continues_exactly(reference / "runs" / "killed", reference / "runs" / "ref", 8)


@pytest.mark.slow
def test_sigterm_mid_step_checkpoints_the_last_finished_step_and_resumes_exactly(reference):
    victim = _launch(reference, "victim", *STEPS, "--train.checkpoint_every=5")
    metrics = reference / "runs" / "victim" / "metrics.jsonl"
    deadline = time.time() + 600
    while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 2):
        if victim.poll() is not None or time.time() > deadline:
            pytest.fail("the run ended before the signal:\n" + victim.communicate()[0][-3000:])
        time.sleep(0.05)
    victim.send_signal(signal.SIGTERM)
    t0 = time.time()
    out, _ = victim.communicate(timeout=120)
    assert victim.returncode == 143, out[-3000:]
    assert time.time() - t0 < 30, "past the grace period (preemption_grace_s=30)"
    found = re.search(r"terminated \(SIGTERM\): stopped cleanly, checkpoint at step (\d+) \(the "
                      r"last finished step\); continue with --resume", out)
    assert found, out[-3000:]
    step = int(found.group(1))
    time.sleep(1)
    left = subprocess.run(["pgrep", "-s", str(victim.pid)], capture_output=True, text=True)
    assert not left.stdout.strip(), f"processes of the run outlived it: {left.stdout}"
    run_dir = reference / "runs" / "victim"
    assert [r["step"] for r in read_metrics(run_dir)] == list(range(step))  # every row, whole
    assert 2 <= step < 8 and step != 5, "not a periodic checkpoint"
    assert (run_dir / "checkpoints" / str(step) / "jaxrl_integrity.json").is_file()
    resumed = _launch(reference, "victim", *STEPS, "--train.checkpoint_every=5", "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    assert "trained as made, not generated again" in out  # the stop finished the batch
    _assert_continues_exactly(run_dir, reference / "runs" / "ref", 8)


def _tiny_gemma3(path):
    """A tiny random Gemma 3 saved by transformers (vocab 128 for the character tokenizer's 100,
    one sliding layer of window 8 and one global, each with its rope base): the task's prompts
    (~36 characters) and their completions run well past its window."""
    return make_windowed_hf("gemma3", path, vocab_size=128, hidden_size=32, intermediate_size=64,
                            num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
                            layer_types=["sliding_attention", "full_attention"])


def _check_lora_exports(run_dir, base_dir, out_dir):
    """The LoRA run's export as one merged model loads in transformers, and as a PEFT adapter
    loads in PEFT onto the base it started from: both give the jaxrl model's logits (f32,
    1e-4) on a sequence 3x past the window, and the adapters moved them from the base's."""
    import peft
    import torch
    import transformers
    from flax import nnx

    from jaxrl.train.export import export_run, load_run

    tokens = (np.arange(3 * WINDOW)[None] * 7) % 100

    def logits(m):
        with torch.no_grad():
            return m(input_ids=torch.tensor(tokens)).logits.numpy()

    ours = np.asarray(nnx.jit(lambda model: model(tokens))(load_run(run_dir)[2]))
    assert not export_run(run_dir, out_dir / "merged", merge=True)["adapter"]
    merged = transformers.AutoModelForCausalLM.from_pretrained(str(out_dir / "merged"))
    assert type(merged).__name__ == "Gemma3ForCausalLM"
    np.testing.assert_allclose(logits(merged.float().eval()), ours, atol=1e-4, rtol=0)
    info = export_run(run_dir, out_dir / "adapter")
    assert info["adapter"] and "adapter_model.safetensors" in info["files"]
    base = transformers.AutoModelForCausalLM.from_pretrained(str(base_dir)).float().eval()
    assert np.abs(logits(base) - ours).max() > 1e-2  # trained adapters, not the base again
    adapted = peft.PeftModel.from_pretrained(base, str(out_dir / "adapter")).eval()
    np.testing.assert_allclose(logits(adapted), ours, atol=1e-4, rtol=0)


@pytest.mark.slow
def test_lora_sigkill_then_resume_continues_exactly(tmp_path):
    """LoRA on a tiny random Gemma 3 (`--init`, sliding window shorter than the prompts): the
    checkpoint holds adapters and their optimiser state, the base is rebuilt from the init
    directory; its own reference (the module's is full-parameter). Then the resumed run exports
    (merged, and as a PEFT adapter) with jaxrl's logits past the window."""
    _tiny_gemma3(tmp_path / "gemma3")
    args = ["--pipeline.steps=6", "--train.checkpoint_every=2", "--model.lora.rank=4",
            f"--init={tmp_path / 'gemma3'}", "--tokenizer=char"]
    ref = _launch(tmp_path, "ref", *args)
    out, _ = ref.communicate(timeout=600)
    assert ref.returncode == 0, out[-3000:]
    victim = _launch(tmp_path, "victim", *args)
    _kill_after(victim, tmp_path / "runs" / "victim", rows=4)
    resumed = _launch(tmp_path, "victim", *args, "--resume")
    out, _ = resumed.communicate(timeout=600)
    assert resumed.returncode == 0, out[-3000:]
    _assert_continues_exactly(tmp_path / "runs" / "victim", tmp_path / "runs" / "ref", 6)
    recorded = read_run_config(tmp_path / "runs" / "victim")
    assert recorded.model.architecture == "gemma3" and recorded.model.sliding_window == WINDOW
    _check_lora_exports(tmp_path / "runs" / "victim", tmp_path / "gemma3", tmp_path / "export")


def _pipeline(stopping, produce_s):
    def produce(step, weights):
        time.sleep(produce_s)
        return batch(step, step, num_rollouts=1, busy_s=produce_s)

    return fake_loop("sync", produce=produce, train=lambda step, p: ({}, {}), initial_params={},
                     publish=lambda params, version: (params, {}))


@pytest.mark.parametrize("signum, kind", [(signal.SIGTERM, Terminated),
                                          (signal.SIGINT, KeyboardInterrupt)])
def test_a_signal_while_waiting_for_a_batch_saves_the_finished_steps(signum, kind):
    stopping, saved = Stopping(5.0), []
    undo = stopping.install()
    try:
        pipeline = _pipeline(stopping, produce_s=0.3)
        threading.Timer(1.0, lambda: signal.raise_signal(signum)).start()  # during step 3
        with pytest.raises(kind, match=r"checkpoint at step \d \(the last finished step\)") as e:
            with stopping.deferred(save=saved.append):
                pipeline.run(start_step=0, num_steps=50, should_stop=stopping.requested)
    finally:
        undo()
    assert type(e.value) is kind and len(saved) == 1 and 1 <= saved[0] <= 5
    assert f"step {saved[0]} " in str(e.value)


def test_no_grace_or_outside_the_steps_stops_at_once():
    for stopping in (Stopping(0.0), Stopping(5.0)):
        undo = stopping.install()
        try:
            with pytest.raises(Terminated):
                if stopping.grace_s:  # not inside deferred(): start-up, SFT, first evaluation
                    signal.raise_signal(signal.SIGTERM)
                else:
                    with stopping.deferred(save=lambda n: pytest.fail("no time to save")):
                        signal.raise_signal(signal.SIGTERM)
        finally:
            undo()


def test_no_safe_point_within_the_grace_period_stops_without_a_checkpoint():
    stopping = Stopping(1.0)
    undo = stopping.install()
    t0 = time.monotonic()
    try:
        with pytest.raises(Terminated, match="no safe point within the grace period"):
            with stopping.deferred(save=lambda n: pytest.fail("no safe point was reached")):
                signal.raise_signal(signal.SIGTERM)
                time.sleep(30)  # a step that does not end
    finally:
        undo()
    assert time.monotonic() - t0 < 10


def test_the_grace_period_is_a_finite_number_of_seconds():
    from jaxrl.config import ConfigError, RunConfig

    assert RunConfig().preemption_grace_s == 30.0
    for bad in (-1.0, float("nan"), float("inf")):
        with pytest.raises(ConfigError, match="preemption_grace_s"):
            RunConfig(preemption_grace_s=bad)
