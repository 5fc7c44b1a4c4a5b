"""Every benchmark `launch/bench.py` names exists; the weight-sync benchmark runs and checks
itself (moved parameters equal the host round trip's and sit on their target shardings)."""

import importlib
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
import bench  # noqa: E402


@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_every_named_benchmark_is_implemented(name):
    assert callable(importlib.import_module(bench.BENCHMARKS[name][0]).main)


def test_unknown_benchmark_is_a_clear_error(capsys):
    assert bench.main(["nope"]) == 2
    err = capsys.readouterr().err
    assert "unknown benchmark 'nope'" in err and "generate, train" in err


def test_help_lists_every_benchmark_and_exits_0():
    out = subprocess.run([sys.executable, str(ROOT / "launch" / "bench.py"), "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    for name in bench.BENCHMARKS:
        assert f"\n  {name} " in out.stdout


@pytest.mark.parametrize("argv, what", [
    (["generate", "--vs", "hf"], "--vs hf needs torch and transformers"),
    (["generate", "--vs", "hf,ct2"], "--vs hf,ct2 needs torch and transformers"),
    (["rl-step", "--vs", "none"], "bench.py rl-step (it writes"),
    (["train", "--vs", "torch"], "--vs torch needs torch and transformers"),
])
def test_peer_benchmarks_name_the_missing_packages_before_jax(argv, what):
    """Without the `bench` extra, a peer comparison stops at once with what is missing and the
    install command, not with an ImportError after building a model."""
    code = ("import sys; sys.modules['torch'] = None\n"  # importlib finds None: not installed
            "sys.path.insert(0, 'launch'); import bench\n"
            "try:\n    bench.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    assert 'jax' not in sys.modules, 'JAX imported before the error'\n"
            "    raise\n")
    res = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                         cwd=ROOT, timeout=120)
    assert res.returncode == 2, res.stderr
    assert what in res.stderr
    assert "missing: torch. Install them with: pip install -e '.[bench]'" in res.stderr


def test_reshard_benchmark_runs_on_the_tiny_model(capsys):
    rc = bench.main(["reshard", "--model", "tiny", "--repeats", "1", "--warmup", "0",
                     "--trainer", "2x1", "--generator", "1x2", "--dtype", "bfloat16",
                     "--lora-rank", "2", "--decode-batch", "2"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["dtype"] == "bfloat16" and out["bytes"] > 0
    # LoRA: the adapters' bytes (f32) only, far fewer than the bf16 full sync's
    assert 0 < out["lora"]["adapter_bytes"] < out["bytes"] / 4
    assert set(out["lora"]["decode_step_s"]) == {"merge", "forward"}
    assert out["trainer_mesh"] == {"fsdp": 2, "tp": 1}
    assert out["generator_mesh"] == {"dp": 1, "tp": 2}
    assert out["weight_sync_gbps"] > 0 and out["speedup_vs_host"] > 0


def test_pipeline_benchmark_compares_modes_under_each_cpu_setting(tmp_path, capsys):
    from jaxrl import cpu

    config = Path(__file__).parent / "rl" / "tiny_config.py"
    settings = "shared" if cpu.split_unavailable() else "shared,split"
    out = tmp_path / "pipe.json"
    rc = bench.main(["pipeline", "--config", str(config), "--steps", "3", "--warmup", "1",
                     "--modes", "sync,periodic", "--cpu-cores", settings, "--repeats", "2",
                     "--out", str(out), f"--data.sft.cache_dir={tmp_path / 'cache'}"])
    assert rc == 0
    text = capsys.readouterr().out
    assert "median of 2 interleaved runs" in text and "vs best sync" in text
    figures = json.loads(out.read_text())
    assert set(figures) == {f"{c}/{m}" for c in settings.split(",") for m in ("sync", "periodic")}
    for entry in figures.values():
        steps = [r["step_s"] for r in entry["runs"]]
        assert len(steps) == 2 and all(s > 0 for s in steps)
        assert entry["median"]["step_s"] == pytest.approx(sum(steps) / 2)
        assert 0 <= entry["median"]["trainer_idle"] <= 1
    if "split" in settings:  # the benchmark gives the XLA threads back every core
        assert not cpu._DEFAULT_MASK
    assert figures["shared/sync"]["median"]["stale_max"] == 0
    assert figures["shared/periodic"]["median"]["stale_max"] <= 1


def test_pipeline_benchmark_rejects_unknown_settings():
    with pytest.raises(SystemExit, match="valid"):
        bench.main(["pipeline", "--cpu-cores", "shared,bogus"])
    with pytest.raises(SystemExit, match="valid"):
        bench.main(["pipeline", "--modes", "sync,eager"])


@pytest.mark.parametrize("overrides", [
    dict(),
    dict(tie_embeddings=False, head_dim=32),  # head_dim != hidden / heads (Qwen3-style)
    dict(architecture="llama", qkv_bias=False),
])
def test_train_benchmark_torch_peer_has_the_jaxrl_model_shapes(overrides):
    """`bench.py train --vs torch` times a `transformers` model built from `config_to_hf`: every
    parameter count and the attention shapes match the jaxrl model (a hand-built Qwen2Config
    fixed tied embeddings and hidden / heads, so these configs timed a different model)."""
    pytest.importorskip("transformers")
    from jaxrl.benchmarks.train import torch_peer_model
    from jaxrl.presets import tiny_model_config

    cfg = tiny_model_config(**overrides)
    model = torch_peer_model(cfg)
    assert type(model).__name__ == {"qwen2": "Qwen2ForCausalLM",
                                    "llama": "LlamaForCausalLM"}[cfg.architecture]
    assert sum(p.numel() for p in model.parameters()) == cfg.num_params()
    q = model.model.layers[0].self_attn.q_proj.weight
    assert tuple(q.shape) == (cfg.num_heads * cfg.head_size, cfg.hidden_size)
    assert model.config.tie_word_embeddings == cfg.tie_embeddings
