"""Config sections take the dtypes JAX users write (jnp.float32 used to be a ConfigError)."""

import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ConfigError, GenerateConfig, ModelConfig, TrainConfig, apply_overrides


@pytest.mark.parametrize("value,name", [(jnp.bfloat16, "bfloat16"), (np.float32, "float32"),
                                        ("bfloat16", "bfloat16"), (jnp.dtype("float16"),
                                                                   "float16")])
def test_sections_store_one_spelling(value, name):
    assert ModelConfig(dtype=value, param_dtype=value).dtype == name
    assert GenerateConfig(dtype=value).dtype == name
    cfg = TrainConfig(param_dtype=value, compute_dtype=value, ref_dtype=value)
    assert (cfg.param_dtype, cfg.compute_dtype, cfg.ref_dtype) == (name, name, name)


def test_bad_dtypes_name_the_key_and_the_choices():
    with pytest.raises(ConfigError, match=r"model.dtype: invalid dtype .*float64.*'bfloat16'"):
        ModelConfig(dtype=np.float64)
    with pytest.raises(ConfigError, match=r"train.compute_dtype: invalid dtype 'int8'"):
        TrainConfig(compute_dtype="int8")
    assert apply_overrides(ModelConfig(), ["--dtype=bfloat16"]).dtype == "bfloat16"
