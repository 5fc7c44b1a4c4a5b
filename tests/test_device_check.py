"""launch/device_check.py: the accelerator check's command lines stay valid, and `--smoke` runs
every step on CPU with rc 0 (so the script is ready when a GPU is lent)."""

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "launch" / "device_check.py"


def _module():
    spec = importlib.util.spec_from_file_location("device_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["device_check"] = module  # its dataclass resolves annotations through it
    spec.loader.exec_module(module)
    return module


def test_full_commands_parse(tmp_path):
    """Every GPU step's command line is accepted by its target's own parser (no JAX needed), so
    a renamed option fails here rather than on a lent machine."""
    from jaxrl.benchmarks import generate, kernels, suite, train
    from jaxrl.config import load_config
    from jaxrl.config.cli import parse_args

    dc = _module()
    parsers = {"generate": generate._parse, "kernels": kernels._parse, "suite": suite._parse,
               "train": lambda a: train._parser().parse_args(a)}
    seen = set()
    for step in dc.steps(tmp_path, tmp_path / "runs"):
        for argv in (step.full, step.smoke):
            script = Path(argv[1]).name if argv[1].endswith(".py") else argv[2]
            if script == "bench.py":
                parsers[argv[2]](argv[3:])
            elif script == "run.py":
                load_config(str(ROOT / "configs" / "default.py"), parse_args(argv[2:]).overrides)
            else:
                assert argv[1:3] == ["-m", "pytest"], argv
            seen.add(script)
    assert seen == {"bench.py", "run.py", "pytest"}
    gen = next(s for s in dc.steps(tmp_path, tmp_path) if s.name == "generate_xla")
    args = generate._parse(gen.full[3:])
    assert (args.hidden, args.layers, args.vocab, args.dtype, args.vs, args.hf_device) == (
        896, 24, 151936, "bfloat16", "hf", "cuda")


def test_wheels_and_missing_packages(tmp_path):
    dc = _module()
    (tmp_path / "array_record-0.8.6-cp312-cp312-manylinux_2_17_x86_64.whl").touch()
    (tmp_path / "tensorboardX-2.6.4-py3-none-any.whl").touch()
    assert dc._wheel_for(tmp_path, "array-record", "0.8.6").name.startswith("array_record-0.8.6")
    assert dc._wheel_for(tmp_path, "tensorboardX", "2.6.5") is None  # another version
    assert dc.missing_packages(["numpy", "no-such-dist-jaxrl"]) == ["no-such-dist-jaxrl"]
    assert dc.jax_platforms({"backend": "gpu", "platform_version": "PJRT C API\ncuda 13"}) == "cuda"


# Steps whose smoke form other tests already run: the kernel tests (tests/kernels, interpreted),
# generate_cudnn (its smoke is generate_xla's command without the peer), generate_int8 (generate_
# fp8's command with another format) and the suite
# (tests/test_bench_suite.py runs `bench.py suite --size smoke`); their command lines are checked
# by test_full_commands_parse. With them this was the second-longest test (210 s, parallel run).
COVERED_ELSEWHERE = {"kernel_tests", "generate_cudnn", "generate_int8", "suite"}


@pytest.mark.slow
def test_smoke_runs_the_steps_no_other_test_runs(tmp_path):
    """Six JAX processes: ~2 min on 2 shared vCPUs."""
    out = tmp_path / "out"
    names = ["env"] + [s.name for s in _module().steps(out, out)
                       if s.name not in COVERED_ELSEWHERE]
    res = subprocess.run([sys.executable, str(SCRIPT), "--smoke", "--out", str(out), "--bundle",
                          str(tmp_path / "bundle"), "--only", ",".join(names[1:])],
                         capture_output=True, text=True, cwd=ROOT, timeout=1500)
    summary = json.loads((out / "summary.json").read_text())
    rows = {r["step"]: r for r in summary["steps"]}
    assert list(rows) == names, res.stdout + res.stderr
    bad = {n: r for n, r in rows.items() if r["rc"] != 0}
    assert not bad, f"{bad}\n{res.stdout}\n{res.stderr}"
    assert res.returncode == 0 and summary["done"]
    assert rows["run"]["figures"].keys() == {"pass@1_before", "pass@1_after"}
    assert rows["generate_xla"]["figures"]["hf_tokens_per_s"] > 0
    assert rows["generate_fp8"]["figures"]["fp8_tokens_per_s"] > 0
    assert rows["generate_fp8"]["figures"]["fp8_ratio"] > 0
    assert rows["train"]["figures"]["jax_mfu"] > 0
    assert (tmp_path / "bundle" / "device_check.tar.gz").stat().st_size > 0
