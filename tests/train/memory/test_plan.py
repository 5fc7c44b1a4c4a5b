"""The memory plan: exact byte counts against hand-derived ones and real sharded arrays, a model
too large for its budget fails before any compilation, the activation estimate against the
compiled step's own memory analysis, and the CLI."""

import dataclasses
import json

import jax
import pytest

from jaxrl.config import (
    ConfigError,
    GenerateConfig,
    ModelConfig,
    PipelineConfig,
    RunConfig,
    TrainConfig,
    load_config,
)
from jaxrl.train.memory.cli import main
from jaxrl.train.memory.fit import check, suggest
from jaxrl.train.memory.plan import plan_memory
from jaxrl.train.memory.step import GiB, MiB, compile_train_step
from jaxrl.train.memory.step import fmt_bytes as _fmt

# E 64, F 128, 2 layers, 4 heads x D 16, 2 kv heads, V 128, tied, no biases
SMALL = ModelConfig(vocab_size=128, hidden_size=64, intermediate_size=128, num_layers=2,
                    num_heads=4, num_kv_heads=2, head_dim=16, qkv_bias=False)


# Qwen2.5-0.5B's published config.json (the values that set shapes)
QWEN2_5_0_5B = {
    "architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", "hidden_size": 896,
    "intermediate_size": 4864, "num_hidden_layers": 24, "num_attention_heads": 14,
    "num_key_value_heads": 2, "vocab_size": 151936, "tie_word_embeddings": True,
    "max_position_embeddings": 32768, "rope_theta": 1000000.0, "rms_norm_eps": 1e-6,
}


def _small_run(**train) -> RunConfig:
    return RunConfig(model=SMALL, train=TrainConfig(**train),
                     generate=GenerateConfig(num_slots=8, max_len=64))


def _plan(cfg, tshape=(1, 1), gshape=(1, 1), **kw):
    kw.setdefault("budget_bytes", GiB)
    return plan_memory(cfg, cfg.model, trainer_mesh_shape=tshape, generator_mesh_shape=gshape,
                       max_seq_len=48, platform="cpu", **kw)


def test_exact_bytes_equal_hand_derived_counts():
    # by hand: embed 128*64; per layer q 64*4*16, k and v 64*2*16, o 4*16*64, mlp 3*64*128,
    # two norms 2*64; final norm 64
    layer = 4096 + 2048 + 2048 + 4096 + 3 * 64 * 128 + 128
    params = 128 * 64 + 2 * layer + 64
    assert params == 82240 == SMALL.num_params()
    plan = _plan(_small_run(micro_batches=2, kl_coef=0.1, ref_dtype="bfloat16"))
    assert plan.item("parameters").bytes == 4 * params
    # AdamW mu + nu in f32, plus two int32 step counts (adam's and the lr schedule's);
    # global-norm clipping holds no state
    assert plan.item("optimizer").bytes == 2 * 4 * params + 2 * 4
    assert plan.item("reference").bytes == 2 * params  # bf16
    assert plan.item("gradients").bytes == 4 * params + 4 * params  # grads + f32 accumulator
    # KV cache: 2 layers x (k, v) x 8 slots x 64 positions x 2 kv heads x 16 x 4 bytes
    assert plan.item("KV cache").bytes == 2 * 2 * 8 * 64 * 2 * 16 * 4
    assert plan.item("weights").bytes == 4 * params
    # sharded: fsdp 2 halves every matrix along embed, norms (5 x 64) stay whole; dp 2 halves
    # the slots, tp 2 halves the kv heads and the generator's matrices (norms whole)
    half = _plan(_small_run(), tshape=(2, 1), gshape=(2, 2))
    norms = 5 * 64
    assert half.item("parameters").bytes == 4 * ((params - norms) // 2 + norms)
    assert half.item("KV cache").bytes == 2 * 2 * 4 * 64 * 1 * 16 * 4
    assert half.item("weights").bytes == 4 * ((params - norms) // 2 + norms)


def test_trainer_bytes_equal_the_real_sharded_state():
    """The plan's per-device figures equal the bytes device 0 holds of a TrainState built on a
    real 2 x 2 trainer mesh."""
    from jaxrl.sharding import make_mesh
    from jaxrl.train.state import init_train_state

    mesh = make_mesh((2, 2), "trainer", jax.devices()[:4])
    cfg = _small_run()
    state = init_train_state(SMALL, cfg.train, mesh)
    dev = jax.devices()[0]

    def on_dev(tree):
        return sum(s.data.nbytes for x in jax.tree.leaves(tree) for s in x.addressable_shards
                   if s.device == dev)

    plan = _plan(cfg, tshape=(2, 2))
    assert plan.item("parameters").bytes == on_dev(state.params)
    assert plan.item("optimizer").bytes == on_dev(state.opt_state)


def test_too_large_for_the_budget_fails_before_any_compilation():
    big = ModelConfig(vocab_size=32000, hidden_size=768, intermediate_size=3072, num_layers=8,
                      num_heads=12, num_kv_heads=12)
    assert 95e6 < big.num_params() < 105e6
    cfg = RunConfig(model=big)
    events = []
    listener = lambda event, duration, **kw: events.append(event)  # noqa: E731
    jax.monitoring.register_event_duration_secs_listener(listener)
    cached = jax.config.jax_enable_compilation_cache
    jax.config.update("jax_enable_compilation_cache", False)  # a cache hit is no compilation
    try:
        jax.jit(lambda x: x * 3.0 + 1.0)(2.0)  # the listener does see a compilation
        assert any("backend_compile" in e for e in events)
        events.clear()
        plan = plan_memory(cfg, big, trainer_mesh_shape=(1, 1), generator_mesh_shape=(1, 1),
                           max_seq_len=64, budget_bytes=64 * MiB, platform="cpu")
        with pytest.raises(ConfigError) as err:
            check(plan)
    finally:
        jax.monitoring.unregister_event_duration_listener(listener)
        jax.config.update("jax_enable_compilation_cache", cached)
    assert not [e for e in events if "compile" in e and "trace" not in e], events
    msg = str(err.value)
    assert _fmt(4 * big.num_params()) in msg  # the parameters' figure, f32
    assert "64.0 MiB" in msg and "DOES NOT FIT" in msg
    assert "settings that would make it fit" in msg
    # 100M f32 parameters + Adam's two moments are ~1.1 GiB on their own: no step setting helps
    assert "the weights and optimizer state alone need" in msg
    assert "--train.param_dtype=bfloat16" in msg or "--train.micro_batches=" in msg


def test_suggestions_are_replanned_figures():
    """Each suggestion's figure is that of the plan with the setting applied."""
    cfg = dataclasses.replace(_small_run(), data=dataclasses.replace(
        RunConfig().data, prompts_per_step=16, group_size=8))
    plan = _plan(cfg, budget_bytes=40 * MiB)
    assert not plan.fits()
    line = next(h for h in suggest(plan) if h.startswith("--train.micro_batches="))
    m = int(line.split("=")[1].split(":")[0])
    fixed = _plan(dataclasses.replace(cfg, train=dataclasses.replace(cfg.train, micro_batches=m)),
                  budget_bytes=40 * MiB)
    assert fixed.fits() and f"-> {_fmt(fixed.need())}" in line
    if m > 2:  # the first that fits: half as many does not
        less = dataclasses.replace(cfg.train, micro_batches=m // 2)
        assert not _plan(dataclasses.replace(cfg, train=less), budget_bytes=40 * MiB).fits()


@pytest.mark.slow
def test_activation_estimate_against_the_compiled_memory_analysis():
    """memory_analysis() exists on CPU in jax 0.10.2: the analytic step estimate (gradients,
    update temporaries, activations) is within a factor 1.5 of the compiled step's temp bytes.
    A shape not used to fit the lm-head term (docs/memory.md): V 512, softmax recomputed."""
    from jaxrl.sharding import make_mesh

    cfg = load_config("configs/default.py", [
        "--data.prompts_per_step=4", "--data.group_size=8", "--train.logprob_chunk=32",
        "--model.vocab_size=512", "--train.lm_head_keep_mb=0"])
    mesh = make_mesh((2, 1), "trainer", jax.devices()[:2])
    compiled = compile_train_step(cfg, cfg.model, mesh, max_seq_len=96)
    plan = plan_memory(cfg, cfg.model, trainer_mesh_shape=(2, 1), generator_mesh_shape=(1, 1),
                       max_seq_len=96, budget_bytes=GiB, platform="cpu", compiled=compiled)
    temp = compiled.memory_analysis().temp_size_in_bytes
    assert plan.item("step temporaries").bytes == temp
    assert "compiled memory_analysis()" in plan.activation_source
    analytic = sum(i.bytes for i in plan.items if i.role == "trainer" and not i.counted)
    assert 1 / 1.5 < analytic / temp < 1.5, (analytic, temp)


def test_cli_prints_the_plan_and_answers_config_errors(tmp_path, capsys):
    assert main(["configs/default.py", "--train.bogus=1"]) == 2
    assert "unknown key 'bogus'" in capsys.readouterr().err
    (tmp_path / "config.json").write_text(json.dumps(QWEN2_5_0_5B))
    rc = main(["configs/qwen2_5_0_5b_gsm8k.py", "--hf-config", str(tmp_path / "config.json"),
               "--prompt-len", "224", "--devices", "1", "--platform", "gpu",
               "--budget-gib", "139"])
    out = capsys.readouterr().out
    # Qwen2.5-0.5B's published parameter count, 494,032,768, in f32 master weights
    line = next(x for x in out.splitlines() if x.startswith("trainer   parameters"))
    assert "(float32, 494.0M)" in line and line.endswith(_fmt(494_032_768 * 4))
    assert "longest sequence 856 tokens" in out  # 224 x 1.5 + 8 + 512 and "colocated" in out
    assert rc in (0, 1) and ("settings that would make it fit" in out) == (rc == 1)


def test_lora_plan_counts_a_bf16_base_and_f32_adapters_by_hand():
    """LoRA rank 8 on every projection of SMALL, base in bf16: by hand, adapters per layer are
    r x (in + out) for q (64 + 64), k and v (64 + 32 each), o (64 + 64), gate and up
    (64 + 128 each), down (128 + 64); the optimiser holds only their two f32 moments."""
    from jaxrl.config import LoraConfig

    r = 8
    per_layer = r * (128 + 96 + 96 + 128 + 192 + 192 + 192)
    adapters = 2 * per_layer
    base = SMALL.num_params()
    model = dataclasses.replace(SMALL, param_dtype="bfloat16", lora=LoraConfig(rank=r))
    cfg = dataclasses.replace(_small_run(), model=model)
    lora_plan, full_plan = _plan(cfg), _plan(_small_run())
    assert lora_plan.item("frozen base").bytes == 2 * base
    assert lora_plan.item("LoRA adapters").bytes == 4 * adapters
    assert lora_plan.item("optimizer").bytes == 2 * 4 * adapters + 2 * 4
    assert lora_plan.item("gradients").bytes == 4 * adapters
    assert full_plan.item("optimizer").bytes == 2 * 4 * base + 2 * 4
    state = lambda plan, names: sum(plan.item(n).bytes for n in names)  # noqa: E731
    lora_state = state(lora_plan, ("frozen base", "LoRA adapters", "optimizer", "gradients"))
    full_state = state(full_plan, ("parameters", "optimizer", "gradients"))
    assert lora_state < full_state / 3  # rank 8 of width 64: adapters are 1/8 of a matrix


def test_sync_counts_the_update_or_generation_not_both():
    """`sync` frees the generator's weights and KV cache during the update (jaxrl.controller
    .pipeline), so on shared memory it needs the larger of (trainer state + update) and (trainer
    state + generator), where `periodic` needs their sum."""
    periodic = _plan(dataclasses.replace(_small_run(), pipeline=PipelineConfig(mode="periodic")),
                     gshape=(2, 1))
    sync = _plan(dataclasses.replace(_small_run(), pipeline=PipelineConfig(mode="sync")),
                 gshape=(2, 1))
    by = {i.name.split(" (")[0]: i.bytes for i in sync.items if i.counted}
    state = by["parameters"] + by["optimizer state"]
    update = by["gradients"] + by["optimizer update temporaries"] + by["batch arrays"] + sum(
        b for name, b in by.items() if name.startswith("activations"))
    gen = by["weights"] + by["KV cache"] + by["decode logits + sampling"]
    assert periodic.need() == state + update + 2 * gen  # one trainer, two generator devices
    assert sync.need() == max(state + update, state + 2 * gen) < periodic.need()
    assert "sync: the update or generation, not both" in sync.format()
    assert "not both" not in periodic.format()
