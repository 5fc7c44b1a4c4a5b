"""Every benchmark `launch/bench.py` names exists; the weight-sync benchmark runs and checks
itself (moved parameters equal the host round trip's and sit on their target shardings)."""

import importlib
import json
import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "launch"))
import bench  # noqa: E402


@pytest.mark.parametrize("name", sorted(bench.BENCHMARKS))
def test_every_named_benchmark_is_implemented(name):
    assert callable(importlib.import_module(bench.BENCHMARKS[name]).main)


def test_unknown_benchmark_is_a_clear_error(capsys):
    assert bench.main(["nope"]) == 2
    assert "generate|train" in capsys.readouterr().err


def test_reshard_benchmark_runs_on_the_tiny_model(capsys):
    rc = bench.main(["reshard", "--model", "tiny", "--repeats", "1", "--warmup", "0",
                     "--trainer", "2x1", "--generator", "1x2", "--dtype", "bfloat16"])
    assert rc == 0
    out = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert out["dtype"] == "bfloat16" and out["bytes"] > 0
    assert out["trainer_mesh"] == {"fsdp": 2, "tp": 1}
    assert out["generator_mesh"] == {"dp": 1, "tp": 2}
    assert out["weight_sync_gbps"] > 0 and out["speedup_vs_host"] > 0
