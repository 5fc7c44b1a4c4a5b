from pathlib import Path

import pytest

from jaxrl.config import (
    ConfigError,
    MeshConfig,
    ModelConfig,
    RunConfig,
    apply_overrides,
    load_config,
)

CONFIGS = sorted((Path(__file__).parent.parent / "configs").glob("*.py"))


def test_configs_dir_is_not_empty():
    assert CONFIGS, "configs/ must ship at least one experiment"


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.stem)
def test_every_shipped_config_parses(path):
    cfg = load_config(path)
    assert isinstance(cfg, RunConfig)
    # Round trip through an override of its own name keeps everything else.
    assert apply_overrides(cfg, [f"--name={cfg.name}"]) == cfg


def test_overrides_set_nested_values_with_types():
    cfg = apply_overrides(
        RunConfig(),
        ["--model.num_layers=4", "--model.rope_theta=5e5", "--model.tie_embeddings=false",
         "--mesh.trainer=2x2", "--mesh.generator=4,1", "--model.dtype=bfloat16",
         "--model.head_dim=none"],
    )
    assert cfg.model.num_layers == 4 and cfg.model.rope_theta == 5e5
    assert cfg.model.tie_embeddings is False and cfg.model.dtype == "bfloat16"
    assert cfg.mesh.trainer == (2, 2) and cfg.mesh.generator == (4, 1)
    assert cfg.model.head_dim is None


def test_override_of_optional_section_creates_it():
    cfg = apply_overrides(RunConfig(), ["--model.rope_scaling.factor=4"])
    assert cfg.model.rope_scaling.factor == 4.0
    assert cfg.model.rope_scaling.low_freq_factor == 1.0


def test_unknown_key_names_key_and_valid_keys():
    with pytest.raises(ConfigError) as e:
        apply_overrides(RunConfig(), ["--model.num_layer=4"])
    msg = str(e.value)
    assert "num_layer" in msg and "num_layers" in msg and "valid keys" in msg


def test_wrong_type_names_key_and_value():
    with pytest.raises(ConfigError) as e:
        apply_overrides(RunConfig(), ["--model.num_layers=four"])
    assert "--model.num_layers" in str(e.value) and "'four'" in str(e.value)
    with pytest.raises(ConfigError, match="boolean"):
        apply_overrides(RunConfig(), ["--model.qk_norm=maybe"])


def test_invalid_enum_lists_choices():
    with pytest.raises(ConfigError) as e:
        apply_overrides(RunConfig(), ["--model.attention_impl=flash"])
    msg = str(e.value)
    assert "'flash'" in msg and "pallas" in msg and "cudnn" in msg and "xla" in msg
    with pytest.raises(ConfigError, match="valid choices"):
        ModelConfig(dtype="float64")


def test_invalid_values_in_post_init():
    with pytest.raises(ConfigError, match="num_kv_heads"):
        ModelConfig(num_heads=4, num_kv_heads=3)
    with pytest.raises(ConfigError, match="must be > 0"):
        apply_overrides(RunConfig(), ["--model.hidden_size=0"])
    with pytest.raises(ConfigError, match="two positive sizes"):
        MeshConfig(trainer=(4,))


def test_malformed_override_and_missing_file(tmp_path):
    with pytest.raises(ConfigError, match="--key.sub=value"):
        apply_overrides(RunConfig(), ["--model.num_layers"])
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.py")
    bad = tmp_path / "bad.py"
    bad.write_text("x = 1\n")
    with pytest.raises(ConfigError, match="config\\(\\)"):
        load_config(bad)


def test_a_shipped_config_is_found_by_name_from_any_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # outside the checkout: `configs/arith.py` is not here
    for name in ("arith", "arith.py", "configs/arith.py"):
        assert load_config(name).name == "arith"
    with pytest.raises(ConfigError) as err:
        load_config("configs/nope.py")
    # The message lists what exists (it listed nothing when it looked in the wrong folder).
    for path in CONFIGS:
        assert repr(path.stem) in str(err.value)
    with pytest.raises(ConfigError, match="not found"):
        load_config("elsewhere/arith.py")  # a folder of the user's own is not redirected
