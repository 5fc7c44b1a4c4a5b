"""Public APIs take the dtypes JAX and numpy users write (`jnp.bfloat16`, `np.float32`,
`"bfloat16"`, `jnp.dtype("float32")`); anything else fails naming the value and the choices."""

import json
import subprocess
import sys

import jax
import jax.numpy as jnp
import ml_dtypes
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import ConfigError
from jaxrl.dtypes import canonical_dtype
from jaxrl.models import create_model, load_pretrained, save_pretrained
from jaxrl.models.hf import read_safetensors
from jaxrl.testing import make_hf_model, tiny_model_config

SPELLINGS = [
    ("float32", "float32"), (np.float32, "float32"), (jnp.float32, "float32"),
    (jnp.dtype("float32"), "float32"), (np.dtype("float32"), "float32"), ("f4", "float32"),
    ("bfloat16", "bfloat16"), (jnp.bfloat16, "bfloat16"), (jnp.dtype("bfloat16"), "bfloat16"),
    (ml_dtypes.bfloat16, "bfloat16"),
    ("float16", "float16"), (np.float16, "float16"), (jnp.float16, "float16"), ("half", "float16"),
]
BAD = ["float64", np.float64, jnp.int32, "int8", "bf16x", None, 3, float]


@pytest.mark.parametrize(("value", "name"), SPELLINGS)
def test_canonical_dtype_reads_every_spelling(value, name):
    assert canonical_dtype(value) == name


@pytest.mark.parametrize("value", BAD)
def test_canonical_dtype_names_the_bad_value_and_the_choices(value):
    with pytest.raises(ValueError) as err:
        canonical_dtype(value, "model.dtype")
    msg = str(err.value)
    assert msg.startswith(f"model.dtype: invalid dtype {value!r}; ")
    assert "['float32', 'bfloat16', 'float16']" in msg


def test_canonical_dtype_raises_the_callers_error_type():
    with pytest.raises(ConfigError, match="x.dtype: invalid dtype 'float64'"):
        canonical_dtype("float64", "x.dtype", ConfigError)


def test_dtypes_module_imports_nothing_heavy():
    """Configs call canonical_dtype: importing it (and reading a valid name) loads no JAX, not
    even numpy (ml_dtypes alone takes most of a second to import)."""
    probe = ("import sys, jaxrl.dtypes; jaxrl.dtypes.canonical_dtype('bfloat16'); "
             "print(sorted(m for m in ('jax', 'flax', 'numpy', 'ml_dtypes') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    path = tmp_path_factory.mktemp("tiny_qwen2")
    make_hf_model("qwen2", path)
    return path


@pytest.mark.parametrize(("dtype", "name"), [
    (jnp.bfloat16, "bfloat16"), (np.float32, "float32"), ("bfloat16", "bfloat16"),
    (jnp.dtype("float32"), "float32"), (jnp.float16, "float16"),
])
def test_load_pretrained_takes_jax_and_numpy_dtypes(hf_dir, dtype, name):
    cfg, model = load_pretrained(hf_dir, dtype=dtype)
    assert (cfg.dtype, cfg.param_dtype) == (name, name)
    assert {x.dtype for x in jax.tree.leaves(nnx.state(model, nnx.Param))} == {jnp.dtype(name)}


def test_load_pretrained_bad_dtype_is_a_clear_error(hf_dir):
    with pytest.raises(ConfigError, match=r"load_pretrained: dtype: invalid dtype <class "
                                          r"'numpy.float64'>; valid choices: \['float32', "
                                          r"'bfloat16', 'float16'\]"):
        load_pretrained(hf_dir, dtype=np.float64)


def test_save_pretrained_takes_a_jax_dtype(tmp_path):
    cfg = tiny_model_config()
    save_pretrained(create_model(cfg, seed=0), cfg, tmp_path, dtype=jnp.bfloat16)
    assert json.loads((tmp_path / "config.json").read_text())["torch_dtype"] == "bfloat16"
    tensors = read_safetensors(tmp_path / "model.safetensors")
    assert {a.dtype for a in tensors.values()} == {np.dtype(ml_dtypes.bfloat16)}
