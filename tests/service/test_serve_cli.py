"""launch/serve.py: argument errors before JAX is imported; the URL printed once it serves."""

from __future__ import annotations

import json
import subprocess
import sys
import urllib.request
from pathlib import Path

SERVE = Path(__file__).resolve().parents[2] / "launch" / "serve.py"


def test_argument_errors_come_before_jax():
    code = (f"import runpy, sys; sys.argv = ['serve.py', '--base-model', 'tiny', '--host', "
            f"'0.0.0.0']\ntry:\n    runpy.run_path({str(SERVE)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    print('exit', e.code, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "exit 2 False" in out.stdout, out
    assert "set --api-key" in out.stderr


def test_serves_and_prints_its_url(tmp_path):
    proc = subprocess.Popen([sys.executable, str(SERVE), "--base-model", "tiny", "--port", "0",
                             "--max-len", "64", "--state-dir", str(tmp_path)],
                            stdout=subprocess.PIPE, text=True)
    try:
        line = proc.stdout.readline()
        assert line.startswith("jaxrl service: http://127.0.0.1:"), line
        url = line.split()[-1]
        with urllib.request.urlopen(f"{url}/api/v1/get_server_capabilities", timeout=30) as r:
            caps = json.load(r)
        assert caps["supported_models"][0]["model_name"] == "tiny"
    finally:
        proc.terminate()
        proc.wait(30)


def test_api_keys_file_is_checked_before_jax(tmp_path):
    keys = tmp_path / "keys"
    keys.write_text("tml-alice\n# a comment\ntml-bob  # bob's\n")
    code = ("import runpy, sys\nsys.argv = ['serve.py', '--base-model', 'tiny', '--api-keys', "
            f"{str(keys)!r}, '--full-params']\ntry:\n    runpy.run_path({str(SERVE)!r}, "
            "run_name='__main__')\nexcept SystemExit as e:\n    print('exit', e.code, 'jax' in "
            "sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "exit 2 False" in out.stdout, out
    assert "--full-params serves a single owner; got 2 keys" in out.stderr
    keys.write_text("tml-alice\nnot-a-tml-key\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "line 2: a key is one word starting with 'tml-'" in out.stderr, out


def test_a_missing_base_model_is_one_error_line_naming_it_once(tmp_path):
    missing = str(tmp_path / "no-such-model")
    out = subprocess.run([sys.executable, str(SERVE), "--base-model", missing],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 2, out
    line = out.stderr.strip().splitlines()[-1]
    assert line.startswith("error: ") and line.count(missing) == 1, line
    assert "Traceback" not in out.stderr


def test_limit_flags_are_checked_before_jax_and_shown_in_help():
    code = ("import runpy, sys\nsys.argv = ['serve.py', '--base-model', 'tiny', "
            "'--max-lora-rank', '0']\ntry:\n    runpy.run_path(" + repr(str(SERVE)) +
            ", run_name='__main__')\nexcept SystemExit as e:\n    print('exit', e.code, 'jax' in "
            "sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert "exit 2 False" in out.stdout, out
    assert "--max-lora-rank must be >= 1, got 0" in out.stderr
    out = subprocess.run([sys.executable, str(SERVE), "--help"], capture_output=True, text=True,
                         timeout=60)
    for flag in ("--max-request-mb", "--max-num-samples", "--max-sample-tokens",
                 "--max-lora-rank"):
        assert flag in out.stdout, flag
