"""Core jaxrl never imports JetStream (it pulls TensorFlow): runs in every environment."""

import subprocess
import sys

CODE = """
import sys
import jaxrl, jaxrl.generate, jaxrl.models, jaxrl.serving, jaxrl.serving.jetstream
heavy = sorted(m for m in ("jetstream", "seqio", "tensorflow") if m in sys.modules)
assert not heavy, heavy
from jaxrl.serving import jetstream as launcher
args = launcher.parse_args(["--model", "tiny"])
assert (args.num_slots, args.max_len, args.temperature) == (8, 1024, 0.0)
"""


def test_core_and_launcher_import_without_jetstream():
    out = subprocess.run([sys.executable, "-c", CODE], capture_output=True, text=True,
                         timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
