"""`--resume` continues a run with its saved config.json (the flags given now on top); a
checkpoint that does not fit the config names the keys that differ; config.json records the
model the run trains (the `--init` model's shape)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
from pathlib import Path

import pytest

from jaxrl.config import ConfigError, DataConfig, PipelineConfig, RunConfig, TrainConfig, to_dict
from jaxrl.config.resume import restore_error, resume_config

ROOT = Path(__file__).resolve().parents[1]


def _launch_main():
    spec = importlib.util.spec_from_file_location("launch_run", ROOT / "launch" / "run.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod.main


def _saved_run(tmp_path: Path, **changes) -> RunConfig:
    """A run directory's config.json as a run with non-default flags wrote it."""
    cfg = RunConfig(name="x", run_dir=str(tmp_path / "runs"),
                    data=DataConfig(task="arith", group_size=4, prompts_per_step=4),
                    pipeline=PipelineConfig(steps=12),
                    train=TrainConfig(checkpoint_every=3), **changes)
    cfg = dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, hidden_size=48))
    cfg.path.mkdir(parents=True)
    (cfg.path / "config.json").write_text(json.dumps(to_dict(cfg), indent=1, default=str))
    return cfg


def test_resume_without_the_original_flags_uses_the_saved_config(tmp_path, capsys):
    """`--name=x --resume` used to rebuild the default config (and then blame the checkpoint
    files); it resumes with config.json, the flags given now applied on top."""
    saved = _saved_run(tmp_path)
    rc = _launch_main()(["--name=x", f"--run_dir={saved.run_dir}", "--resume",
                         "--pipeline.steps=20", "--print-config"])
    assert rc == 0, capsys.readouterr().err
    got = json.loads(capsys.readouterr().out)
    assert got["data"]["task"] == "arith" and got["data"]["group_size"] == 4
    assert got["model"]["hidden_size"] == 48 and got["train"]["checkpoint_every"] == 3
    assert got["pipeline"]["steps"] == 20  # the flag given now wins

    cfg, changed = resume_config(RunConfig(), ["--name", "x", f"--run_dir={saved.run_dir}",
                                               "--pipeline.steps=20"])
    assert cfg == dataclasses.replace(saved, pipeline=PipelineConfig(steps=20))
    assert changed == ["pipeline.steps: 12 -> 20"]


def test_resume_of_a_run_whose_task_is_not_registered_says_how(tmp_path):
    saved = _saved_run(tmp_path)
    raw = json.loads((saved.path / "config.json").read_text())
    raw["data"]["task"] = "api_sums_8619b04c"
    (saved.path / "config.json").write_text(json.dumps(raw))
    with pytest.raises(ConfigError) as e:
        resume_config(RunConfig(), ["--name=x", f"--run_dir={saved.run_dir}"])
    assert "data.task='api_sums_8619b04c'" in str(e.value)
    assert "pass that file with --config" in str(e.value)


def test_a_checkpoint_that_does_not_fit_names_the_differing_keys(tmp_path):
    saved = _saved_run(tmp_path)
    failed = ConfigError("no usable checkpoint (step 3: it does not load: ValueError: tree "
                         "structures do not match); nothing was changed: restore the files")
    now = dataclasses.replace(saved, pipeline=PipelineConfig(steps=20),
                              model=dataclasses.replace(saved.model, hidden_size=32,
                                                        num_layers=3))
    err = restore_error(now, saved.path, failed)
    assert isinstance(err, ConfigError) and err is not failed
    text = str(err)
    assert "model.hidden_size: 48 -> 32" in text and "model.num_layers: 2 -> 3" in text
    assert "pipeline.steps" not in text  # a key that does not decide the checkpoint's contents
    assert "--name=x --resume" in text and "tree structures do not match" in text
    # the same config (or one that differs only in keys that do not shape the checkpoint):
    # the files are the problem, and the original error says so
    steps_only = dataclasses.replace(saved, pipeline=PipelineConfig(steps=20))
    assert restore_error(steps_only, saved.path, failed) is failed


def test_config_json_records_the_init_models_shape(tmp_path):
    """config.json's `model` section showed `cfg.model`'s defaults for an `--init` run."""
    from jaxrl.rl.metrics import prepare_run_dir
    from jaxrl.tokenizers import CharTokenizer
    from jaxrl.train.init import model_config, recorded_config

    model = tmp_path / "hf"
    model.mkdir()
    (model / "config.json").write_text(json.dumps({
        "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 300,
        "hidden_size": 48, "intermediate_size": 80, "num_hidden_layers": 3,
        "num_attention_heads": 4, "num_key_value_heads": 2, "max_position_embeddings": 256,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "tie_word_embeddings": False}))
    cfg = RunConfig(name="i", run_dir=str(tmp_path / "runs"), init=str(model), tokenizer="char")
    assert cfg.model.hidden_size != 48  # the defaults differ from the init model
    model_cfg = model_config(cfg, CharTokenizer())
    recorded = recorded_config(cfg, model_cfg)
    run_dir = prepare_run_dir(recorded, False, leader=True)  # as jaxrl/run.py writes it
    written = json.loads((run_dir / "config.json").read_text())["model"]
    assert (written["hidden_size"], written["intermediate_size"], written["num_layers"],
            written["vocab_size"], written["tie_embeddings"]) == (48, 80, 3, 300, False)
    assert recorded.model == model_cfg
