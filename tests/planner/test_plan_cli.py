"""launch/plan.py end to end (subprocess), and its override parsing."""

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.planner import cli
from jaxrl.planner.specs import Workload

ROOT = Path(__file__).resolve().parents[2]


def plan(*args, env_extra=None):
    env = {**os.environ, "PYTHONPATH": str(ROOT), **(env_extra or {})}
    return subprocess.run([sys.executable, str(ROOT / "launch" / "plan.py"), *args],
                          capture_output=True, text=True, env=env, timeout=120)


def test_preset_with_simulation_and_trace(tmp_path):
    trace = tmp_path / "plan_trace.json"
    r = plan("--model", "qwen3-8b", "--hardware", "h100", "--chips", "16", "--split", "8:8",
             "--workload.batch_size=128", "--workload.group_size=8",
             "--workload.response_mean=1024", "--workload.response_max=4096",
             "--simulate", "--steps", "4", "--trace", str(trace))
    assert r.returncode == 0, r.stderr
    out = r.stdout
    assert "recommended:" in out and "predicted gain over baseline 8:8" in out
    assert "speedup per mode" in out and "simulator" in out
    for mode in ("sync", "periodic", "async", "inflight"):
        assert f"best {mode}" in out
    events = json.loads(trace.read_text())["traceEvents"]
    assert any(e["name"] == "train_step" for e in events)


def run_main(capsys, *args):
    rc = cli.main(list(args))
    out, err = capsys.readouterr()
    return rc, out, err


def test_bad_preset_lists_valid_names(capsys):
    rc, _, err = run_main(capsys, "--model", "gpt-17")
    assert rc == 2
    assert "gpt-17" in err and "qwen3-235b-a22b" in err and "glm-5" in err
    rc, _, err = run_main(capsys, "--hardware", "a100")
    assert rc == 2 and "tpu-v6e" in err


def test_published_and_list(capsys):
    rc, out, err = run_main(capsys, "--published")
    assert rc == 0, err
    assert "29.1%" in out and "104:152" in out and "48:208" in out
    rc, out, _ = run_main(capsys, "--list")
    assert rc == 0 and "tpu-v5e" in out and "inflight" in out


def test_from_run(tmp_path, capsys):
    run = tmp_path / "runs" / "x"
    run.mkdir(parents=True)
    row = {"pipeline/rollouts_per_s_produced": 1.0, "pipeline/rollouts_per_s_consumed": 2.0,
           "pipeline/trainer_idle_frac": 0.5}
    (run / "metrics.jsonl").write_text("\n".join(json.dumps(row) for _ in range(5)) + "\n")
    rc, _, err = run_main(capsys, "--from-run", str(run))
    assert rc == 2 and "pipeline/trainer_chips" in err
    rc, out, err = run_main(capsys, "--from-run", str(run), "--split", "4:4")
    assert rc == 0, err
    assert "recommended: 3:5" in out  # trainer twice as fast per chip -> more generators
    rc, _, err = run_main(capsys, "--from-run", str(tmp_path / "missing"))
    assert rc == 2 and "metrics.jsonl" in err


def test_overrides_are_strict():
    w = cli.apply(Workload(), {"batch_size": "64", "response_sigma": "0.5",
                               "prefix_sharing": "false"}, "workload")
    assert (w.batch_size, w.response_sigma, w.prefix_sharing) == (64, 0.5, False)
    with pytest.raises(ValueError, match="unknown field workload.bsz; valid: .*batch_size"):
        cli.apply(Workload(), {"bsz": "64"}, "workload")
    with pytest.raises(ValueError, match="expects int"):
        cli.apply(Workload(), {"batch_size": "many"}, "workload")
    with pytest.raises(ValueError, match="SECTION.FIELD"):
        cli.parse_overrides(["--bogus"])
    assert cli.main(["--workload.nope=1"]) == 2


def test_sandbox_cores_count_turns_and_tool_latency(capsys):
    from jaxrl.planner.analytic import predict, sandbox_cores
    from jaxrl.planner.hardware import get_hardware
    from jaxrl.planner.specs import Efficiency, get_model

    w = Workload(batch_size=128, group_size=8, response_mean=1024, response_max=4096,
                 sandbox_exec_s=0.5, turns_per_episode=4, tool_latency_s=0.3)
    eff = Efficiency(sandbox_utilization=0.8)
    # 3 tool calls x 0.3 s + 0.5 s of reward = 1.4 core-s per sample; at 10 samples/s and 80%
    # busy: 10 x 1.4 / 0.8 = 17.5 cores
    assert w.sandbox_s_per_sample == pytest.approx(1.4)
    assert sandbox_cores(w, 10.0, eff) == pytest.approx(17.5)
    p = predict(get_model("qwen3-8b"), get_hardware("h100"), w, eff, 8, 8)
    assert p.sandbox_cores == pytest.approx(p.generator.samples_per_s * 1.4 / 0.8)
    one_turn = dataclasses.replace(w, turns_per_episode=1)  # tools cost nothing then
    assert one_turn.sandbox_s_per_sample == 0.5
    rc, out, err = run_main(capsys, "--model", "qwen3-8b", "--hardware", "h100", "--chips", "16",
                            "--split", "8:8", "--workload.batch_size=128",
                            "--workload.group_size=8", "--workload.response_mean=1024",
                            "--workload.response_max=4096", "--workload.sandbox_exec_s=0.5",
                            "--workload.turns_per_episode=4", "--workload.tool_latency_s=0.3",
                            "--eff.sandbox_utilization=0.8")
    assert rc == 0, err
    line = next(ln for ln in out.splitlines() if "sandbox cores" in ln)
    assert "3 tool calls x 0.3 s + reward 0.5 s" in line and "1.4 s/sample" in line, line
    rec = next(ln for ln in out.splitlines() if ln.startswith("recommended:"))
    rate = float(rec.split("-> ")[1].split()[0])  # samples/s of the recommended split and mode
    cores = float(line.split("sandbox cores ")[1].split()[0])
    assert cores == pytest.approx(rate * 1.4 / 0.8, abs=0.06)
    rc, _, err = run_main(capsys, "--workload.turns_per_episode=0.5")
    assert rc == 2 and "turns_per_episode" in err
