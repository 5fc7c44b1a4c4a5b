"""`launch/export.py`: a run's checkpoint as a Hugging Face directory that `transformers` loads,
with logits equal to jaxrl's; bad arguments answered before JAX is imported."""

import dataclasses
import importlib.util
import json
import subprocess
import sys
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import GenerateConfig, MeshConfig, RunConfig
from jaxrl.presets import tiny_model_config
from jaxrl.rl import metrics as build
from jaxrl.sharding import make_meshes
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.config import TrainConfig
from jaxrl.train.init import register_lora_base
from jaxrl.train.trainer import Trainer

ROOT = Path(__file__).resolve().parent.parent
EXPORT = ROOT / "launch" / "export.py"


def _export_main():
    spec = importlib.util.spec_from_file_location("launch_export", EXPORT)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


@pytest.fixture(scope="module")
def run(tmp_path_factory):
    """A run directory as `jaxrl.run` leaves it (config.json + an orbax checkpoint at step 3),
    its trained-looking params perturbed away from the seeded init."""
    tmp = tmp_path_factory.mktemp("export")
    cfg = RunConfig(name="r", run_dir=str(tmp / "runs"),
                    model=tiny_model_config(hidden_size=32, intermediate_size=64, num_heads=2,
                                            num_kv_heads=1, tie_embeddings=False),
                    mesh=MeshConfig(trainer=(1, 1), generator=(1, 1)),
                    train=TrainConfig(lr=1e-3),
                    generate=GenerateConfig(temperature=0.7, top_p=0.9))
    run_dir = build.prepare_run_dir(cfg, False, leader=True)
    mesh = make_meshes(cfg.mesh).trainer
    trainer = Trainer(cfg.model, cfg.train, mesh)
    noise = jax.tree.map(lambda p: 0.05 * jnp.ones_like(p), trainer.state.params)
    trainer.replace_state(trainer.state.replace(
        params=jax.tree.map(jnp.add, trainer.state.params, noise)))
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=3)
    ckpt.save(trainer.state, step=3)
    ckpt.close()
    params = jax.device_get(trainer.state.params)
    return dict(cfg=cfg, dir=run_dir, params=params, graphdef=trainer.graphdef)


def test_export_loads_in_transformers_with_equal_logits(run, tmp_path, capsys):
    import torch
    import transformers

    out = tmp_path / "hf"
    assert _export_main()([str(run["dir"]), str(out)]) == 0
    assert "step 3" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == ["config.json", "generation_config.json", "model.safetensors"], names
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == 1 and gen["pad_token_id"] == 0  # the char tokenizer's
    assert gen["temperature"] == 0.7 and gen["top_p"] == 0.9 and gen["do_sample"] is True
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert transformers.GenerationConfig.from_pretrained(str(out)).eos_token_id == 1

    model = nnx.merge(run["graphdef"], run["params"])  # the trainer's own params, not the export
    tokens = np.random.RandomState(0).randint(3, 98, (2, 11))
    positions = np.broadcast_to(np.arange(11), tokens.shape)
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions),
                            jnp.ones(tokens.shape, jnp.int32)))
    with torch.no_grad():
        ref = hf(input_ids=torch.tensor(tokens)).logits.numpy()
    assert ours.shape == ref.shape
    assert np.abs(ours - ref).max() < 1e-4, np.abs(ours - ref).max()
    assert np.abs(ours).max() > 0.1  # logits that mean something


def test_bad_arguments_answered_before_jax(run, tmp_path):
    """Each bad argument: exit code 2, a message naming it, and JAX never imported."""
    code = ("import runpy, sys\n"
            "sys.argv = ['export.py'] + sys.argv[1:]\n"
            f"try:\n    runpy.run_path({str(EXPORT)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    print('rc', e.code, 'jax' in sys.modules)\n"
            )
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x").write_text("x")
    cases = [
        ([str(tmp_path / "nope"), str(tmp_path / "o")], "no such run directory"),
        ([str(tmp_path), str(tmp_path / "o")], "not a jaxrl run directory"),
        ([str(run["dir"]), str(tmp_path / "o"), "--step", "7"], "checkpoints at steps [3]"),
        ([str(run["dir"]), str(tmp_path / "full")], "is not empty"),
    ]
    for argv, message in cases:
        start = time.perf_counter()
        proc = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True,
                              text=True, timeout=60, cwd=ROOT)
        elapsed = time.perf_counter() - start
        assert "rc 2 False" in proc.stdout, (argv, proc.stdout, proc.stderr)
        assert message in proc.stderr, (argv, proc.stderr)
        assert elapsed < 10, elapsed  # generous: no JAX import (which takes 5-15 s here)
    assert not (tmp_path / "o").exists()


@pytest.mark.slow
def test_generate_cli_reads_a_run_directory(run, capsys):
    """`python -m jaxrl.generate --model runs/<name>`: the run's latest checkpoint and its
    tokenizer (before: its config.json was read as a Hugging Face config and failed)."""
    from jaxrl.generate.__main__ import main

    assert main(["--model", str(run["dir"]), "--prompt", "1+1=", "--max-tokens", "3",
                 "--logprobs"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt 0 sample 0" in out and "tokens in" in out
    # greedy continuation equals the trainer params' own greedy tokens
    from jaxrl.generate import SamplingParams, sample
    from jaxrl.tokenizers import CharTokenizer

    tok = CharTokenizer()
    want = sample(nnx.merge(run["graphdef"], run["params"]), [tok.encode("1+1=")],
                  SamplingParams(max_tokens=3, temperature=0.0), eos_ids=[tok.eos_id])
    assert f"tokens: {want[0].tokens}" in out


@pytest.mark.slow
def test_a_run_whose_task_this_process_never_registered_exports_and_samples(run, tmp_path,
                                                                             capsys):
    """An API run (or an experiment file's own `register_task`) records a task that only its
    process registered; exporting and sampling its policy need no task (before: `data.task=
    'api_sums_8619b04c' is not valid`)."""
    import shutil

    from jaxrl.config.data import task_names
    from jaxrl.generate.__main__ import main as generate_main

    run_dir = tmp_path / "api_run"
    shutil.copytree(run["dir"], run_dir)
    raw = json.loads((run_dir / "config.json").read_text())
    raw["data"] = {**raw["data"], "task": "api_sums_8619b04c", "paths": []}
    (run_dir / "config.json").write_text(json.dumps(raw))
    assert "api_sums_8619b04c" not in task_names()

    out = tmp_path / "hf"
    assert _export_main()([str(run_dir), str(out)]) == 0, capsys.readouterr().err
    from safetensors.numpy import load_file

    exported = load_file(str(out / "model.safetensors"))
    embed = np.asarray(run["params"]["embed"])
    assert np.array_equal(exported["model.embed_tokens.weight"], embed)  # the run's weights
    assert generate_main(["--model", str(run_dir), "--prompt", "1+1=", "--max-tokens", "2"]) == 0
    assert "--- prompt 0 sample 0" in capsys.readouterr().out


def test_resume_with_other_model_dims_names_the_keys_not_the_files(run, tmp_path):
    """The checkpoint of a run with hidden_size=32 restored into a hidden_size=48 trainer:
    orbax's "tree structures do not match" becomes an error naming the differing config keys
    (before: "does not load ... restore the files")."""
    import shutil

    from jaxrl.config import ConfigError
    from jaxrl.train.checkpoint import NoUsableCheckpoint, naming_config_differences

    run_dir = tmp_path / "r"
    shutil.copytree(run["dir"], run_dir)
    cfg = dataclasses.replace(run["cfg"], model=dataclasses.replace(
        run["cfg"].model, hidden_size=48, intermediate_size=96))
    trainer = Trainer(cfg.model, cfg.train, make_meshes(cfg.mesh).trainer)
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=3)
    with pytest.raises(ConfigError) as e:
        with naming_config_differences(cfg, run_dir):  # as jaxrl/run.py opens them
            ckpt.restore_newest(trainer.abstract_state)
    ckpt.close()
    assert not isinstance(e.value, NoUsableCheckpoint)
    assert "model.hidden_size: 32 -> 48; model.intermediate_size: 64 -> 96" in str(e.value)
    assert "restore the files" not in str(e.value)
    assert (run_dir / "checkpoints" / "3").is_dir()  # nothing moved aside


@pytest.fixture(scope="module")
def lora_run(tmp_path_factory):
    """A LoRA run directory as `jaxrl.run` leaves it: the adapters (B non-zero) and their
    optimiser state in the checkpoint, the digest of the seeded base beside them."""
    from jaxrl.config import LoraConfig
    from jaxrl.models import create_model, lora
    from jaxrl.train.state import params_from_model

    tmp = tmp_path_factory.mktemp("export_lora")
    cfg = RunConfig(name="lora", run_dir=str(tmp / "runs"),
                    model=tiny_model_config(hidden_size=32, intermediate_size=64, num_heads=2,
                                            num_kv_heads=1, tie_embeddings=False,
                                            lora=LoraConfig(rank=4, alpha=8.0)),
                    mesh=MeshConfig(trainer=(1, 1), generator=(1, 1)),
                    train=TrainConfig(lr=1e-3))
    run_dir = build.prepare_run_dir(cfg, False, leader=True)
    mesh = make_meshes(cfg.mesh).trainer
    plain = dataclasses.replace(cfg.model, lora=LoraConfig())
    base = params_from_model(create_model(plain, mesh=mesh, seed=cfg.seed))  # as run.py does
    trainer = Trainer(cfg.model, cfg.train, mesh, params=base)
    keys = iter(jax.random.split(jax.random.key(5), 100))
    adapters = jax.tree.map(lambda p: 0.3 * jax.random.normal(next(keys), p.shape, p.dtype),
                            trainer.state.params)
    trainer.replace_state(trainer.state.replace(params=adapters))
    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=3)
    register_lora_base(ckpt, trainer, cfg)
    ckpt.save(trainer.state, step=2)
    ckpt.close()
    params = jax.device_get(lora.join(trainer.frozen, trainer.state.params))
    return dict(cfg=cfg, dir=run_dir, params=params, graphdef=trainer.graphdef)


def _torch_logits(model, tokens):
    import torch

    with torch.no_grad():
        return model(input_ids=torch.tensor(tokens)).logits.numpy()


def test_lora_run_exports_a_peft_adapter_and_a_merged_model(lora_run, tmp_path, capsys):
    peft = pytest.importorskip("peft")
    import transformers

    model = nnx.merge(lora_run["graphdef"], lora_run["params"])  # the trainer's own params
    tokens = np.random.RandomState(0).randint(3, 98, (2, 11))
    positions = np.broadcast_to(np.arange(11), tokens.shape)
    ours = np.asarray(model(jnp.asarray(tokens), jnp.asarray(positions),
                            jnp.ones(tokens.shape, jnp.int32)))

    out = tmp_path / "adapter"
    assert _export_main()([str(lora_run["dir"]), str(out)]) == 0
    assert "step 2 as a PEFT adapter" in capsys.readouterr().out
    names = sorted(p.name for p in out.iterdir())
    assert names == ["adapter_config.json", "adapter_model.safetensors", "base",
                     "generation_config.json"], names
    raw = json.loads((out / "adapter_config.json").read_text())
    assert raw["r"] == 4 and raw["lora_alpha"] == 8.0 and len(raw["target_modules"]) == 7
    base = transformers.AutoModelForCausalLM.from_pretrained(raw["base_model_name_or_path"])
    plain = _torch_logits(base.float().eval(), tokens)
    assert np.abs(ours - plain).max() > 0.1  # the adapters matter
    pm = peft.PeftModel.from_pretrained(base, str(out)).eval()
    assert np.abs(ours - _torch_logits(pm, tokens)).max() < 1e-4

    merged = tmp_path / "merged"
    assert _export_main()([str(lora_run["dir"]), str(merged), "--merge"]) == 0
    assert sorted(p.name for p in merged.iterdir()) == [
        "config.json", "generation_config.json", "model.safetensors"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(str(merged)).float().eval()
    assert np.abs(ours - _torch_logits(hf, tokens)).max() < 1e-4


def test_lora_export_refuses_a_base_other_than_the_runs(lora_run, tmp_path, capsys):
    """The base is rebuilt from the run's config; one that differs from the base the adapters
    were trained on (here: another seed) is refused, not exported."""
    import shutil

    run_dir = tmp_path / "run"
    shutil.copytree(lora_run["dir"], run_dir)
    raw = json.loads((run_dir / "config.json").read_text())
    (run_dir / "config.json").write_text(json.dumps({**raw, "seed": 1}))
    assert _export_main()([str(run_dir), str(tmp_path / "out")]) == 2
    assert "trained on another base" in capsys.readouterr().err
