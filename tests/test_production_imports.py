"""Production code never imports the test fixtures in `jaxrl.testing` (which pull in torch and
transformers); what it needs from them lives in production modules (`jaxrl.presets`)."""

import ast
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
FIXTURES = "jaxrl.testing"


def _imported_modules(text: str, package: str) -> list[tuple[int, str]]:
    """(line, module) for every import in `text` (a module of `package`), relative imports
    resolved, `from a import b` giving both `a` and `a.b` (b may be a module)."""
    out = []
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, ast.Import):
            out += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[: len(parts) - node.level + 1] + ([base] if base else []))
            out.append((node.lineno, base))
            out += [(node.lineno, f"{base}.{alias.name}") for alias in node.names]
    return out


def _production_files() -> list[Path]:
    files = [p for p in (ROOT / "jaxrl").rglob("*.py") if p != ROOT / "jaxrl" / "testing.py"]
    files += [*(ROOT / "launch").glob("*.py"), *(ROOT / "configs").glob("*.py")]
    return sorted(files)


def test_import_walker_sees_every_spelling():
    """The walker itself: absolute, from-package, relative and function-local imports."""
    spellings = ["import jaxrl.testing", "from jaxrl import testing",
                 "from jaxrl.testing import tiny_model_config", "from .. import testing",
                 "from ..testing import make_hf_model",
                 "def f():\n    from jaxrl.testing import TINY_HF_KW"]
    for code in spellings:  # as if in jaxrl/serving/
        assert FIXTURES in {m for _, m in _imported_modules(code, "jaxrl.serving")}, code
    assert FIXTURES not in {m for _, m in _imported_modules("import jaxrl.testing_x", "jaxrl")}


def test_production_modules_do_not_import_jaxrl_testing():
    files = _production_files()
    assert len(files) > 50, "the walk found too few files to mean anything"
    offenders = []
    for path in files:
        package = ".".join(path.relative_to(ROOT).parts[:-1])
        offenders += [f"{path.relative_to(ROOT)}:{line}"
                      for line, module in _imported_modules(path.read_text(), package)
                      if module == FIXTURES]
    assert not offenders, f"production code imports {FIXTURES}: {offenders}"


def test_presets_are_the_one_tiny_model_definition():
    """The tests' tiny model is the production preset itself, and presets import no JAX."""
    import jaxrl.testing
    from jaxrl import presets

    assert jaxrl.testing.tiny_model_config is presets.tiny_model_config
    cfg = presets.tiny_model_config(num_layers=1)
    assert (cfg.num_layers, cfg.hidden_size, cfg.vocab_size, cfg.qkv_bias) == (1, 64, 128, True)
    task = presets.tiny_task_model_config()
    assert (task.num_layers, task.hidden_size, task.intermediate_size) == (4, 128, 384)
    # head dim 128 / 4 = 32; per layer: q,k,v,o 128*32*(2*4 + 2*2) = 49152, q/k/v biases
    # 32*(4 + 2*2) = 256, mlp 3*128*384 = 147456, two norms 256; then the final norm 128 and the
    # tied embedding 128*128: 804_992, the "~0.8M params" the docs state
    assert task.num_params() == 4 * (49152 + 256 + 147456 + 256) + 128 + 16384 == 804_992
    probe = ("import sys, jaxrl.presets; "
             "print(sorted(m for m in ('jax', 'jaxlib', 'flax') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
