"""Analytic model, recommendation, hardware table and measured-rates feedback."""

import json
import math
from pathlib import Path

import pytest

from jaxrl.planner import hardware
from jaxrl.planner.analytic import (
    MODES,
    Infeasible,
    generator_model,
    pipeline_rates,
    predict,
    trainer_min_chips,
)
from jaxrl.planner.measured import from_measured, read_run
from jaxrl.planner.recommend import analytic_evaluator, recommend, recommend_analytic
from jaxrl.planner.specs import Efficiency, ModelSpec, Workload, get_model

W = Workload(prompt_len=1024, response_mean=4096, response_sigma=0.8, response_max=16384,
             group_size=8, batch_size=512, sandbox_exec_s=2.0)
EFF = Efficiency()


def test_moe_reads_between_active_and_total_params():
    m = get_model("qwen3-235b-a22b")
    assert m.params_read(1) == pytest.approx(m.active_params)
    reads = [m.params_read(b) for b in (1, 4, 32, 512)]
    assert reads == sorted(reads) and reads[-1] <= m.total_params
    assert reads[-1] == pytest.approx(m.total_params, rel=1e-3)
    dense = get_model("qwen3-8b")
    assert dense.params_read(1) == dense.params_read(100) == dense.total_params


def test_generator_decode_is_memory_bound_and_kv_limited():
    m, hw = get_model("qwen3-8b"), hardware.get_hardware("h100")
    gen = generator_model(m, hw, W, EFF, chips=8)
    assert gen.replica_chips == 1 and gen.replicas == 8
    # One sequence: the step is the weight read at the assumed bandwidth efficiency.
    t1 = gen.step_time(1, 0)
    assert t1 == pytest.approx(m.total_params * 2 / (hw.hbm_bw * EFF.decode_bw_eff))
    assert gen.step_time(64, 64 * 5000) > t1  # KV reads add time
    small = generator_model(m, hw, W, Efficiency(kv_mem_frac=0.3), chips=8)
    assert small.slots < gen.slots  # less memory for KV, fewer concurrent sequences
    assert gen.samples_per_s_at(4) < gen.samples_per_s_at(64)


def test_trainer_rate_is_6n_plus_logprob_passes():
    m, hw = get_model("qwen3-8b"), hardware.get_hardware("h100")
    eff = Efficiency(count_attention=False)
    w0 = Workload(prompt_len=1, response_mean=999, response_sigma=0, response_max=999,
                  group_size=1, batch_size=1, logprob_passes=0)
    w1 = Workload(prompt_len=1, response_mean=999, response_sigma=0, response_max=999,
                  group_size=1, batch_size=1, logprob_passes=1)
    p0 = predict(m, hw, w0, eff, 8, 8).trainer
    p1 = predict(m, hw, w1, eff, 8, 8).trainer
    assert p0.flops_per_sample == pytest.approx(6 * m.active_params * 1000)
    assert p0.samples_per_s / p1.samples_per_s == pytest.approx(8 / 6)


def test_infeasible_splits():
    m, hw = get_model("qwen3-235b-a22b"), hardware.get_hardware("h100")
    with pytest.raises(Infeasible, match="trainer state"):
        predict(m, hw, W, EFF, trainer_min_chips(m, hw, EFF) - 1, 64)
    with pytest.raises(Infeasible, match="per replica"):
        predict(m, hw, W, EFF, 64, 4)


def test_pipeline_modes_order():
    # X = 50 s training, S = 5 s publish, barrier 150 s, free-running generation 100 s.
    r = {m: pipeline_rates(m, 100, 2.0, 1.0, sync_s=5.0, gen_batch_s=150.0) for m in MODES}
    assert r["sync"].step_s == pytest.approx(150 + 5 + 50)
    assert r["periodic"].step_s == pytest.approx(150)  # generation-bound, training hidden
    assert r["async"].step_s == pytest.approx(150)
    assert r["inflight"].step_s == pytest.approx(100)  # no barrier
    assert r["sync"].consumed_per_s < r["periodic"].consumed_per_s <= r["inflight"].consumed_per_s
    assert r["periodic"].trainer_idle == pytest.approx(1 - 55 / 150)
    assert r["periodic"].train_frac == pytest.approx(50 / 150)
    # Trainer-bound: the step is the train step plus its publish.
    assert pipeline_rates("async", 100, 1.0, 10.0, sync_s=5.0).step_s == pytest.approx(105)
    # One cycle (generate, score, train, publish) spread over ahead + 1 steps.
    cyc = pipeline_rates("periodic", 100, 2.0, 1.0, gen_batch_s=60.0, sandbox_latency_s=40.0)
    assert cyc.step_s == pytest.approx((60 + 40 + 50) / 2)
    assert pipeline_rates("async", 100, 2.0, 1.0, staleness=0).step_s == pytest.approx(150)
    with pytest.raises(ValueError, match="valid.*periodic"):
        pipeline_rates("overlap", 100, 2.0, 1.0)


@pytest.mark.parametrize("hw_name", ["h200", "tpu-v5p"])
@pytest.mark.parametrize("granularity", [1, None])
def test_recommended_split_beats_every_other(hw_name, granularity):
    m, hw = get_model("qwen3-8b"), hardware.get_hardware(hw_name)
    rec = recommend_analytic(m, hw, W, EFF, 64, baseline=(32, 32, "periodic"),
                             granularity=granularity)
    step = granularity or (hw.chips_per_node if 64 >= 2 * hw.chips_per_node else 1)
    best = rec.best.rates.consumed_per_s
    evaluate = analytic_evaluator(m, hw, W, EFF)
    checked = 0
    for t in range(step, 64, step):
        try:
            rates = evaluate(t, 64 - t)
        except Infeasible:
            continue
        checked += 1
        assert all(best >= r.consumed_per_s * (1 - 1e-9) for r in rates.values())
    assert checked >= 7
    assert rec.best.trainer_chips % step == 0
    assert rec.gain >= 0
    assert set(rec.best_per_mode()) == set(MODES)
    assert all(0 <= c.mfu <= EFF.trainer_mfu for c in rec.candidates)


def test_recommend_respects_allowed_modes_and_reports_infeasible():
    m, hw = get_model("qwen3-8b"), hardware.get_hardware("h100")
    rec = recommend_analytic(m, hw, W, EFF, 16, modes=["sync"])
    assert {c.rates.mode for c in rec.candidates} == {"sync"}
    huge = ModelSpec("huge", 4e12, 4e12, 100, 16384, 128, 8, 128, 100000)
    with pytest.raises(ValueError, match="no feasible split"):
        recommend(16, analytic_evaluator(huge, hw, W, EFF))


def test_hardware_table_has_sources_and_bad_names_list_valid_ones():
    for spec in hardware.HARDWARE.values():
        assert "datasheet" in spec.source or "documentation" in spec.source
    assert {"h100", "h200", "b200", "tpu-v5e", "tpu-v5p", "tpu-v6e"} <= set(hardware.HARDWARE)
    with pytest.raises(ValueError, match="valid.*h200"):
        hardware.get_hardware("a100")
    with pytest.raises(ValueError, match="valid.*glm-5"):
        get_model("llama-9000")


def test_local_cpu_is_measured_once_and_cached(tmp_path, monkeypatch):
    calls = []
    real_measure = hardware.measure_cpu

    def fake_measure():
        calls.append(1)
        return real_measure(matmul_n=64, copy_bytes=1 << 20, repeats=1)

    monkeypatch.setattr(hardware, "measure_cpu", fake_measure)
    monkeypatch.setenv("JAXRL_CACHE_DIR", str(tmp_path))
    a = hardware.get_hardware("cpu")
    b = hardware.get_hardware("cpu")
    assert len(calls) == 1 and a == b and a.peak_flops > 0 and a.hbm_bw > 0
    assert "measured" in a.source and (tmp_path / "cpu_hardware.json").exists()
    hardware.local_cpu(refresh=True)
    assert len(calls) == 2


def test_spec_validation_names_bad_values():
    with pytest.raises(ValueError, match="multiple of group_size"):
        Workload(group_size=16, batch_size=100)
    with pytest.raises(ValueError, match="trainer_mfu.*1.5"):
        Efficiency(trainer_mfu=1.5)
    with pytest.raises(ValueError, match="active_params"):
        ModelSpec("x", 1e9, 2e9, 1, 1, 1, 1, 1, 1)


def _write_metrics(run_dir, rows):
    run_dir.mkdir(parents=True, exist_ok=True)
    with open(run_dir / "metrics.jsonl", "w") as f:
        for row in rows:
            f.write(json.dumps(row) + "\n")


def synthetic_rows(n=20):
    """Rows as jaxrl/rl/loop.py writes them: rates per second of busy time."""
    rows = []
    for step in range(n):
        rows.append({
            "step": step, "pipeline/rollouts_per_s_produced": 1.95 + 0.01 * (step % 3 - 1),
            "pipeline/rollouts_per_s_consumed": 2.75, "pipeline/trainer_idle_frac": 0.29,
            "pipeline/generator_idle_frac": 0.0, "pipeline/weight_sync_s": 4.0,
            "pipeline/trainer_busy_s": 512 / 2.75, "pipeline/step_s": 262.6,
            "train/mfu": 0.148, "sandbox/exec_s_p50": 12.0, "pipeline/trainer_chips": 64,
            "pipeline/generator_chips": 192, "pipeline/mode": "async",
        })
    rows[0]["pipeline/rollouts_per_s_consumed"] = 0.1  # warm-up step, skipped
    return rows


def test_from_measured_synthetic_run(tmp_path):
    _write_metrics(tmp_path / "run", synthetic_rows())
    metrics = read_run(tmp_path / "run")
    assert metrics["pipeline/rollouts_per_s_consumed"] == 2.75
    assert metrics["pipeline/rollouts_per_s_produced"] == pytest.approx(1.95)
    assert metrics["pipeline/mode"] == "async"
    rec = from_measured(metrics, granularity=8)
    assert rec.baseline.split == "64:192" and rec.baseline.rates.mode == "async"
    assert rec.baseline.rates.trainer_idle == pytest.approx(1 - 1.95 / 2.75)
    assert rec.best.split == "48:208" and rec.gain == pytest.approx(0.058, abs=0.002)
    assert rec.best.mfu > rec.baseline.mfu
    assert set(rec.best_per_mode()) == set(MODES)  # batch size inferred: all modes compared
    assert any("trainer idle: measured 29.0%, predicted 29.1%" in n for n in rec.notes)
    assert any("step time: measured 262.6 s, predicted 262.6 s" in n for n in rec.notes)
    note = next(n for n in rec.notes if n.startswith("sandbox"))
    assert int(note.split()[1]) == math.ceil(rec.best.rates.consumed_per_s * 12.0 / 0.8)


def test_sandbox_note_claims_no_more_cores_than_the_machine_has(tmp_path):
    """The note said "3 CPU cores keep up" on a 2-core machine."""
    _write_metrics(tmp_path / "run", synthetic_rows())
    metrics = read_run(tmp_path / "run")
    rec = from_measured(metrics, granularity=8, cpu_cores=2)
    need = math.ceil(rec.best.rates.consumed_per_s * 12.0 / 0.8)
    assert need > 2
    note = next(n for n in rec.notes if n.startswith("sandbox"))
    assert note.startswith(f"sandbox: {need} CPU cores would keep up with the recommended split")
    assert "but this machine has 2: the rewards limit the rate" in note
    assert f"{need} CPU cores keep up" not in note
    rec = from_measured(metrics, granularity=8, cpu_cores=need)
    note = next(n for n in rec.notes if n.startswith("sandbox"))
    assert note.startswith(f"sandbox: {need} CPU cores keep up") and note.endswith(
        f"this machine has {need}")


def test_from_measured_missing_keys_are_named(tmp_path):
    with pytest.raises(ValueError, match="pipeline/trainer_chips"):
        from_measured({"pipeline/rollouts_per_s_produced": 1.0,
                       "pipeline/rollouts_per_s_consumed": 1.0})
    rec = from_measured({"pipeline/rollouts_per_s_produced": 1.0,
                         "pipeline/rollouts_per_s_consumed": 1.0},
                        trainer_chips=4, generator_chips=4)
    assert {c.rates.mode for c in rec.candidates} == {"async"}  # no batch size: own mode only
    with pytest.raises(FileNotFoundError, match="metrics.jsonl"):
        read_run(tmp_path / "nothing")


def test_tiny_preset_matches_the_default_experiment_model():
    config = pytest.importorskip("jaxrl.config")
    root = Path(__file__).resolve().parents[2]
    m, ref = get_model("tiny"), config.load_config(root / "configs" / "default.py").model
    assert m.total_params == ref.num_params(), "update the 'tiny' preset in jaxrl/planner/specs.py"
    assert (m.layers, m.hidden, m.heads, m.kv_heads, m.head_dim, m.vocab) == (
        ref.num_layers, ref.hidden_size, ref.num_heads, ref.num_kv_heads, ref.head_size,
        ref.vocab_size)
