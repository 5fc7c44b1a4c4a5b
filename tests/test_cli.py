"""launch/run.py's command line: errors before JAX starts, --help lists every key, --print-config,
`--key value` as well as `--key=value`, the strict errors kept."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
import time
import typing
from pathlib import Path

import pytest

from jaxrl.config import ConfigError, RunConfig, apply_overrides
from jaxrl.config.overrides import _strip_optional

ROOT = Path(__file__).resolve().parents[1]
LAUNCH = ROOT / "launch" / "run.py"


def _launch(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ, JAX_PLATFORMS="cpu")
    return subprocess.run([sys.executable, str(LAUNCH), *args], capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT, env=env)


def _leaf_keys(cls: type, prefix: str = "") -> list[str]:
    """Every settable dotted key of a config class, walked from the type hints."""
    keys = []
    hints = typing.get_type_hints(cls)
    for f in dataclasses.fields(cls):
        inner, _ = _strip_optional(hints[f.name])
        if dataclasses.is_dataclass(inner):
            keys += _leaf_keys(inner, f"{prefix}{f.name}.")
        else:
            keys.append(prefix + f.name)
    return keys


def test_a_bad_flag_fails_before_jax_is_imported():
    """The 8-14 s per CLI error came from importing JAX before parsing the config."""
    probe = (f"import sys; sys.path.insert(0, {str(LAUNCH.parent)!r}); import run; "
             "rc = run.main(['--nope=1']); "
             "print('RC', rc, [m for m in ('jax', 'numpy', 'jaxrl.run') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "RC 2 []" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "unknown key 'nope'" in out.stderr


def test_a_bad_flag_exits_within_seconds():
    t0 = time.perf_counter()
    out = _launch("--nope=1")
    wall = time.perf_counter() - t0
    assert out.returncode == 2
    assert "--nope: unknown key 'nope'" in out.stderr and "valid keys" in out.stderr
    assert wall < 5.0, f"{wall:.1f}s"  # ~0.3 s measured (docs/benchmarks.md); bound generous


def test_help_lists_every_key_with_value_and_description():
    out = _launch("--help")
    assert out.returncode == 0, out.stderr
    text = out.stdout
    cfg = RunConfig()
    for key in _leaf_keys(RunConfig):
        assert f"--{key}=" in text, key
    for flag in ("--config", "--resume", "--quiet", "--print-config"):
        assert flag in text
    # the README's keys, with the value the default experiment gives them
    for key in ("name", "init", "tokenizer"):
        assert f"\n  --{key}=" in text, key
    assert "--name=default " in text
    # descriptions come from the fields' own comments (checked against the source text)
    line = next(ln for ln in text.splitlines() if ln.startswith("  --pipeline.steps="))
    source = (ROOT / "jaxrl" / "config" / "sections.py").read_text()
    comment = next(ln for ln in source.splitlines() if ln.strip().startswith("steps: int"))
    assert comment.split("#", 1)[1].strip() in line
    # or, for a field without a comment, from its class docstring's `name   description` table
    line = next(ln for ln in text.splitlines() if ln.startswith("  --data.train_size="))
    assert "size of one epoch of a procedural task" in line
    # grouped by section, each titled with its class's docstring
    for section in ("model", "mesh", "train", "data", "data.sft", "generate", "rewards",
                    "pipeline", "dist"):
        assert f"\n{section}: " in text, section
    assert text.index("\ndata: ") < text.index("\n  --data.task=") < text.index("\ndata.sft: ")
    assert cfg.pipeline.mode in text


def test_print_config_prints_the_resolved_config_and_space_separated_values():
    out = _launch("--print-config", "--pipeline.steps", "7", "--data.sft.cache=false",
                  "--name", "x", "--config", "configs/arith.py")
    assert out.returncode == 0, out.stderr
    cfg = json.loads(out.stdout)
    assert cfg["pipeline"]["steps"] == 7 and cfg["name"] == "x"
    assert cfg["data"]["sft"]["cache"] is False
    assert cfg["data"]["task"] == "arith"  # from the --config file
    assert not (ROOT / "runs" / "x").exists()


def test_key_value_pairs_match_key_equals_value():
    a = apply_overrides(RunConfig(), ["--model.num_layers", "3", "--pipeline.mode", "sync",
                                      "--seed", "-3", "--mesh.colocated"])
    b = apply_overrides(RunConfig(), ["--model.num_layers=3", "--pipeline.mode=sync",
                                      "--seed=-3", "--mesh.colocated=true"])
    assert a == b and a.model.num_layers == 3 and a.mesh.colocated is True


@pytest.mark.parametrize("args, needle", [
    (["--model.num_layers"], "needs a value"),
    (["--pipeline.mode", "fast"], "valid choices: ['sync', 'periodic', 'async', 'inflight']"),
    (["--model.num_layers", "four"], "expected int, got 'four'"),
    (["--model.nope", "1"], "unknown key 'nope' in ModelConfig"),
    (["stray"], "unexpected argument 'stray'"),
    (["--model", "x"], "is a section"),
])
def test_space_form_keeps_the_strict_errors(args, needle):
    with pytest.raises(ConfigError) as e:
        apply_overrides(RunConfig(), args)
    assert needle in str(e.value)


def test_launcher_flag_errors():
    out = _launch("--resume=yes")
    assert out.returncode == 2 and "--resume takes no value" in out.stderr
    out = _launch("--config")
    assert out.returncode == 2 and "--config needs a path" in out.stderr


@pytest.mark.parametrize("paths, needle", [
    ("missing.jsonl", "error: data path 'missing.jsonl' does not exist"),
    ("bad.jsonl", "error: bad.jsonl:2: malformed JSON"),
])
def test_bad_data_is_an_error_line_not_a_traceback(tmp_path, paths, needle):
    """Data the run cannot read stops it with `error: ...` (exit 2) naming the file and line."""
    (tmp_path / "bad.jsonl").write_text('{"question": "1+1", "final": 2}\nnot json\n')
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))  # run from tmp_path
    out = subprocess.run(
        [sys.executable, str(LAUNCH), "--name=bad", f"--run_dir={tmp_path / 'runs'}",
         "--data.task=records", f"--data.paths={paths}", "--data.prompt_template={question}",
         "--data.answer_field=final", "--data.reward=math_answer", "--data.sft.steps=0"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert needle in out.stderr and "Traceback" not in out.stderr, out.stderr[-3000:]


def test_sft_launcher_bad_data_is_an_error_line(tmp_path):
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(ROOT / "launch" / "sft.py"), str(ROOT / "configs" / "default.py"),
         "--data.task=records", "--data.paths=missing.jsonl", "--data.prompt_template={q}",
         "--data.answer_field=a", "--data.reward=math_answer"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 1, out.stderr[-3000:]
    assert out.stderr.strip().endswith("error: data path 'missing.jsonl' does not exist")
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


def test_an_unsupported_architecture_is_an_error_line_and_writes_no_run(tmp_path):
    """A model jaxrl does not implement stops the run with `error: init=...` (exit 2), naming the
    architectures it does, before the run directory is written."""
    model = tmp_path / "gpt2"
    model.mkdir()
    (model / "config.json").write_text(json.dumps(
        {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "vocab_size": 300}))
    env = dict(os.environ, JAX_PLATFORMS="cpu", PYTHONPATH=str(ROOT))
    out = subprocess.run(
        [sys.executable, str(LAUNCH), "--name=gpt2", f"--run_dir={tmp_path / 'runs'}",
         f"--init={model}", "--tokenizer=char"],
        capture_output=True, text=True, timeout=300, cwd=tmp_path, env=env)
    assert out.returncode == 2, out.stderr[-3000:]
    assert f"error: init='{model}': unsupported architecture ['GPT2LMHeadModel']" in out.stderr
    assert "MistralForCausalLM" in out.stderr and "Traceback" not in out.stderr
    assert not (tmp_path / "runs").exists()


def test_sft_launcher_help_exits_0_with_usage():
    """`launch/sft.py --help` printed the usage as an error and exited 1."""
    for flag in ("--help", "-h"):
        out = subprocess.run([sys.executable, str(ROOT / "launch" / "sft.py"), flag],
                             capture_output=True, text=True, timeout=60, cwd=ROOT)
        assert out.returncode == 0, out.stderr
        assert out.stdout.startswith("usage: python launch/sft.py <config.py>")
        assert "--export-hf=DIR" in out.stdout and "launch/run.py --config" in out.stdout


def test_a_run_dir_that_cannot_be_written_is_an_error_line_before_jax(tmp_path, monkeypatch):
    """An unwritable --run_dir used to end in a NotADirectoryError / PermissionError traceback
    from the run directory's mkdir, after JAX, the model and the data had started."""
    afile = tmp_path / "afile"
    afile.write_text("")
    probe = (f"import sys; sys.path.insert(0, {str(LAUNCH.parent)!r}); import run; "
             f"rc = run.main(['--run_dir={afile / 'runs'}']); "
             "print('RC', rc, [m for m in ('jax', 'jaxrl.run') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                         timeout=120, cwd=ROOT)
    assert "RC 2 []" in out.stdout, (out.stdout, out.stderr[-2000:])
    assert "is a file, not a directory; choose another --run_dir" in out.stderr
    assert "Traceback" not in out.stderr
    from jaxrl.train import run_dir

    monkeypatch.setattr(run_dir.os, "access", lambda path, mode: False)  # read-only (root ignores
    with pytest.raises(ConfigError, match="cannot create run directories in .*read-only"):  # modes)
        run_dir.check_writable(tmp_path / "runs")


def test_the_api_gets_the_same_error_from_the_run_directory(tmp_path):
    from jaxrl.rl.metrics import prepare_run_dir

    (tmp_path / "afile").write_text("")
    cfg = dataclasses.replace(RunConfig(), run_dir=str(tmp_path / "afile" / "runs"))
    with pytest.raises(ConfigError, match="run_dir=.*cannot create .*choose another run_dir"):
        prepare_run_dir(cfg, resume=False, leader=True)
