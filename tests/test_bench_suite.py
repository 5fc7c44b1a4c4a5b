"""`bench.py suite` writes a document the schema accepts; the schema rejects broken ones; and
`report.py` renders documents of several machines as a table and PNG charts."""

import copy
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from jaxrl.benchmarks import report, schema, suite

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "launch"))
import bench  # noqa: E402


def _entry(figures, status="ok", reason=None, peer=None, roofline=None):
    return {"status": status, "reason": reason, "seconds": 1.0, "command": "x",
            "figures": figures, "peer": peer, "roofline": roofline or {}}


def _doc(name: str, scale: float) -> dict:
    """A hand-written document (figures made up, `scale` apart between machines)."""
    machine = {"name": name, "backend": "cpu", "device_kind": "cpu", "device_count": 8,
               "chips": 1, "device_memory_bytes": None, "host_cpu": "test cpu", "host_cores": 2,
               "load_average": [1.0, 1.0, 1.0], "jax": "0", "jaxlib": "0", "flax": "0",
               "jaxrl_commit": "unknown"}
    benchmarks = {
        "generate": _entry({"tokens_per_s_per_chip": 100.0 * scale},
                           roofline={"bandwidth_frac": 0.1 * scale}),
        "train": _entry({"tokens_per_s_per_chip": 50.0 * scale}, roofline={"mfu": 0.2 * scale},
                        peer={"name": "torch", "figures": {"step_s": 2.0}}),
        "reshard": _entry({"weight_sync_gbps": 3.0 * scale}),
        "sandbox": _entry({"exec_per_s_per_core": 200.0 * scale}),
        "pipeline": _entry({"async/speedup_vs_sync": 1.5}),
        "kernels": _entry({}, status="skipped", reason="no accelerator"),
        "rl_step": _entry({"step_s": 1.0 / scale, "rollouts_per_s_per_chip": 32.0 * scale}),
    }
    return {"schema_version": schema.SCHEMA_VERSION, "size": "smoke", "created": "2026-12-01",
            "command": "c", "machine": machine,
            "roofline": {"matmul_peak_flops": 1e11, "memory_gbps": 10.0, "method": "m"},
            "workload": {"prompts_per_step": 8}, "benchmarks": benchmarks}


def test_schema_accepts_a_document_and_rejects_broken_ones():
    schema.validate(_doc("a", 1.0))
    broken = [
        lambda d: d.pop("machine"),
        lambda d: d["machine"].pop("jaxrl_commit"),
        lambda d: d["machine"].__setitem__("device_count", "eight"),
        lambda d: d["benchmarks"].pop("kernels"),  # every benchmark is present, maybe skipped
        lambda d: d["benchmarks"]["kernels"].__setitem__("reason", None),  # skipped: say why
        lambda d: d["benchmarks"]["train"]["figures"].__setitem__("mfu", [0.1]),  # not flat
        lambda d: d.__setitem__("schema_version", schema.SCHEMA_VERSION + 1),
        lambda d: d.__setitem__("size", "huge"),
    ]
    for i, breaker in enumerate(broken):
        doc = copy.deepcopy(_doc("a", 1.0))
        breaker(doc)
        with pytest.raises(schema.SchemaError):
            schema.validate(doc)
            pytest.fail(f"broken document {i} validated")


def test_flat_joins_nested_figures_and_nulls_non_finite_values():
    assert suite.flat({"a": {"b": 1, "c": float("nan")}, "d": [1, 2], "e": "x"}) == {
        "a/b": 1, "a/c": None, "d": "1, 2", "e": "x"}


def test_suite_cli_rejects_a_bad_size_before_running(tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        bench.main(["suite", "--size", "huge", "--json", str(tmp_path / "x.json")])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert "'huge'" in err and "smoke, small, full" in err


def _check_png(path: Path, min_size=(300, 200)):
    from PIL import Image

    with Image.open(path) as im:
        assert im.format == "PNG" and im.size[0] >= min_size[0] and im.size[1] >= min_size[1]
        pixels = np.asarray(im.convert("L"), np.float32)
    assert pixels.std() > 5, f"{path.name} looks blank"


def test_report_renders_two_machines_as_table_and_charts(tmp_path, capsys):
    files = []
    for name, scale in (("box-a", 1.0), ("box-b", 2.0)):
        files.append(tmp_path / f"{name}.json")
        files[-1].write_text(json.dumps(_doc(name, scale)))
    assert report.main([*map(str, files), "--out", str(tmp_path / "r")]) == 0
    table = (tmp_path / "r" / "report.md").read_text()
    assert "| figure | box-a | box-b |" in table
    assert "| weight sync (GB/s) | 3 | 6 |" in table
    assert "| trainer MFU (vs measured peak) | 20% | 40% |" in table
    assert "| kernels: decode B=256 L=8192 (GB/s) | – | – |" in table  # skipped
    pngs = sorted((tmp_path / "r").glob("*.png"))
    assert len(pngs) == len(report.CHARTS) >= 3
    for p in pngs:
        _check_png(p)
    # a document that is not a suite result is named
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"schema_version": 1}))
    assert report.main([str(bad), "--no-charts"]) == 2
    assert "bad.json" in capsys.readouterr().err


@pytest.mark.slow
def test_smoke_suite_writes_a_valid_document_that_report_renders(tmp_path):
    out = tmp_path / "x.json"
    proc = subprocess.run([sys.executable, "launch/bench.py", "suite", "--size", "smoke",
                           "--json", str(out), "--name", "ci-cpu"], cwd=ROOT,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "suite: rl_step starts" in proc.stderr and "suite: wrote" in proc.stderr
    doc = json.loads(out.read_text())
    schema.validate(doc)
    runs = doc["benchmarks"]
    assert {k: v["status"] for k, v in runs.items()} == {
        **{k: "ok" for k in schema.BENCHMARK_NAMES}, "kernels": "skipped"}
    assert "interpret" in runs["kernels"]["reason"]
    # the fixed workload, as configs/bench_suite.py defines it
    sys.path.insert(0, str(ROOT / "configs"))
    import bench_suite

    assert doc["workload"]["prompts_per_step"] == bench_suite.PROMPTS_PER_STEP
    assert doc["workload"]["group_size"] == bench_suite.GROUP_SIZE
    rl = runs["rl_step"]["figures"]
    assert rl["rollouts_per_s"] * rl["step_s"] == pytest.approx(
        bench_suite.PROMPTS_PER_STEP * bench_suite.GROUP_SIZE)  # wall clock, not busy time
    assert runs["train"]["figures"]["tokens_per_s"] * runs["train"]["figures"]["step_s"] == (
        pytest.approx(8 * 64))  # the smoke size's batch x seq
    assert runs["sandbox"]["peer"]["name"].startswith("fresh python3")
    assert 0 < runs["generate"]["roofline"]["bandwidth_frac"] < 1.5
    second = json.loads(out.read_text())
    second["machine"]["name"] = "ci-cpu-copy"
    (tmp_path / "y.json").write_text(json.dumps(second))
    rep = subprocess.run([sys.executable, "launch/report.py", str(out), str(tmp_path / "y.json"),
                          "--out", str(tmp_path / "r")], cwd=ROOT, capture_output=True,
                         text=True, timeout=120)
    assert rep.returncode == 0, rep.stderr
    assert "| figure | ci-cpu | ci-cpu-copy |" in rep.stdout
    for p in sorted((tmp_path / "r").glob("*.png"))[:3]:
        _check_png(p)
