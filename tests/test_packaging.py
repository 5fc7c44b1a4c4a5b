"""Packaging: installing jaxrl claims the import names `jaxrl` and `jaxrl_kernels`, never `kernels`.

`kernels` on PyPI is another project (Hugging Face's kernel hub, used with `transformers`); the
top-level folder `kernels/` installs as `jaxrl_kernels` (setup.py). Run from outside the checkout:
Python puts the working directory on sys.path, where the folder `kernels/` is always importable.
From the checkout's root (the tests, `python -m ...`), the folder hands the name `kernels` over to
an installed package of that name: `transformers` >= 5.25 depends on Hugging Face's and imports it
whenever a model module loads.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
OURS = {"jaxrl", "jaxrl_kernels"}


def _py(code: str, cwd: Path, *flags: str, env: dict | None = None) -> dict:
    out = subprocess.run([sys.executable, *flags, "-c", code], cwd=cwd, capture_output=True,
                         text=True, timeout=120, env=env)
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout.splitlines()[-1])


PROBE = """
import importlib.util, json
spec = lambda name: getattr(importlib.util.find_spec(name), "origin", None)
print(json.dumps({"kernels": spec("kernels"), "jaxrl_kernels": spec("jaxrl_kernels")}))
"""


def _sources(folder: Path) -> set[str]:
    return {p.relative_to(folder).as_posix() for p in folder.rglob("*")
            if p.suffix in (".py", ".cc", ".toml") and "__pycache__" not in p.parts}


def test_installed_jaxrl_claims_no_kernels_name(tmp_path):
    """The installed distribution (here: this environment's, editable or not) lists only jaxrl's
    own top-level names, and `jaxrl_kernels` is this checkout's kernels/ folder."""
    meta = _py("import importlib.metadata as m, json; "
               "print(json.dumps(m.distribution('jaxrl').read_text('top_level.txt').split()))",
               tmp_path)
    assert set(meta) == OURS, f"jaxrl installs top-level names {meta}; expected {sorted(OURS)}"
    found = _py(PROBE, tmp_path)
    assert found["jaxrl_kernels"] is not None, "jaxrl_kernels does not import outside the checkout"
    installed = Path(found["jaxrl_kernels"]).read_bytes()
    assert installed == (ROOT / "kernels" / "__init__.py").read_bytes()
    kernels = found["kernels"]
    assert kernels is None or not Path(kernels).resolve().is_relative_to(ROOT), (
        f"`import kernels` resolves to jaxrl's folder ({kernels}); it must stay free for the "
        "PyPI package of that name")


def test_wheel_maps_kernels_folder_to_jaxrl_kernels(tmp_path):
    """Build the wheel from a copy of the sources: its top-level names are jaxrl and
    jaxrl_kernels, it holds every source file of both folders (Python, C++, data tables), and
    once unpacked on sys.path (what `pip install` does) `kernels` does not resolve to it while
    `jaxrl_kernels` does."""
    src = tmp_path / "src"
    ignore = shutil.ignore_patterns("__pycache__", "*.egg-info", "build")
    for name in ("jaxrl", "kernels"):
        shutil.copytree(ROOT / name, src / name, ignore=ignore)
    for name in ("setup.py", "pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, src / name)
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                    "-q", "-w", str(tmp_path / "dist"), str(src)], check=True, timeout=300,
                   capture_output=True)
    (wheel,) = (tmp_path / "dist").glob("jaxrl-*.whl")
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        top_level = next(n for n in names if n.endswith(".dist-info/top_level.txt"))
        assert set(zf.read(top_level).decode().split()) == OURS
        zf.extractall(tmp_path / "site")
    roots = {n.split("/")[0] for n in names if not n.split("/")[0].endswith(".dist-info")}
    assert roots == OURS, f"wheel top-level entries {sorted(roots)}; expected {sorted(OURS)}"
    for folder, name in (("jaxrl", "jaxrl"), ("kernels", "jaxrl_kernels")):
        missing = _sources(ROOT / folder) - _sources(tmp_path / "site" / name)
        assert not missing, f"the wheel lacks {folder}/ files {sorted(missing)} (a folder without "\
                            "__init__.py is not a package)"
    # -S: no site-packages, so neither this environment's editable jaxrl nor anything else.
    found = _py(f"import sys; sys.path.insert(0, {str(tmp_path / 'site')!r})\n" + PROBE,
                tmp_path, "-S")
    assert found["kernels"] is None
    assert found["jaxrl_kernels"] == str(tmp_path / "site" / "jaxrl_kernels" / "__init__.py")


# an installed `kernels` laid out as Hugging Face's: a package importing its own parts
FAKE_HUB = {
    "kernels/__init__.py": "from kernels.layer import CUDAProperties\n",
    "kernels/layer.py": "CUDAProperties = 'the installed kernels'\n",
}
NAMES = """
import json, kernels
from kernels import CUDAProperties
print(json.dumps({"file": kernels.__file__, "name": CUDAProperties}))
"""


def test_from_the_checkout_root_kernels_is_the_installed_package(tmp_path):
    """With the checkout's root first on sys.path (`python -c` run there puts '' first) and a
    package named `kernels` installed further down, `import kernels` and `from kernels import
    ...` give the installed package and its own submodules, not jaxrl's folder (before: an
    ImportError for every name the folder lacks)."""
    for name, text in FAKE_HUB.items():
        (tmp_path / "site" / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / "site" / name).write_text(text)
    env = {**os.environ, "PYTHONPATH": str(tmp_path / "site")}
    found = _py(NAMES, ROOT, env=env)
    assert found == {"file": str(tmp_path / "site" / "kernels" / "__init__.py"),
                     "name": "the installed kernels"}
    # No other `kernels` (-S: no site-packages): the folder stays, and says what it is.
    alone = _py("import json, kernels; print(json.dumps(kernels.__file__))", ROOT, "-S")
    assert alone == str(ROOT / "kernels" / "__init__.py")


def test_transformers_model_modules_import_from_the_checkout_root():
    """What the test suite does from the checkout's root: `transformers` builds a model
    (activations, hub kernels, the model's module). With `transformers` 5.25 this failed on
    `from kernels import CUDAProperties` reaching jaxrl's folder."""
    code = ("import json, transformers\n"
            "cfg = transformers.LlamaConfig(vocab_size=16, hidden_size=8, intermediate_size=16, "
            "num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1)\n"
            "model = transformers.LlamaForCausalLM(cfg)\n"
            "print(json.dumps(sum(p.numel() for p in model.parameters())))")
    assert _py(code, ROOT) > 0
