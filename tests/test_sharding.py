import jax
import pytest
from jax.sharding import PartitionSpec as P

from jaxrl.config import ConfigError, MeshConfig
from jaxrl.sharding import logical_sharding, logical_to_spec, make_meshes


def test_default_split_is_disjoint_halves():
    m = make_meshes(MeshConfig())
    assert m.trainer.axis_names == ("fsdp", "tp") and m.generator.axis_names == ("dp", "tp")
    t, g = set(m.trainer.devices.flat), set(m.generator.devices.flat)
    assert len(t) == 4 and len(g) == 4 and not (t & g)
    assert not m.colocated


def test_explicit_shapes_and_colocated():
    m = make_meshes(MeshConfig(trainer=(2, 2), generator=(1, 4)))
    assert m.trainer.shape == {"fsdp": 2, "tp": 2} and m.generator.shape == {"dp": 1, "tp": 4}
    c = make_meshes(MeshConfig(trainer=(8, 1), generator=(4, 2), colocated=True))
    assert c.colocated
    one = make_meshes(MeshConfig(), devices=jax.devices()[:1])
    assert one.colocated and one.trainer.size == 1


def test_mesh_that_does_not_fit_says_available_vs_requested():
    with pytest.raises(ConfigError) as e:
        make_meshes(MeshConfig(trainer=(4, 2), generator=(2, 1)))
    msg = str(e.value)
    assert "8 device(s) available" in msg and "10 requested" in msg
    with pytest.raises(ConfigError, match="available"):
        make_meshes(MeshConfig(trainer=(16, 1), colocated=True))


def test_logical_rules_per_role_and_divisibility():
    m = make_meshes(MeshConfig(trainer=(2, 2), generator=(2, 2)))
    assert logical_to_spec(("embed", "mlp"), "trainer") == P("fsdp", "tp")
    assert logical_to_spec(("embed", "mlp"), "generator") == P(None, "tp")
    assert logical_to_spec(("cache_batch", "length", "kv_heads", "head_dim"), "generator") == P(
        "dp", None, "tp", None
    )
    # 3 kv heads do not divide over tp=2: replicated instead of failing.
    s = logical_sharding(m.generator, "generator", ("embed", "kv_heads", "head_dim"), (8, 3, 4))
    assert s.spec == P(None, None, None)
    with pytest.raises(ValueError, match="unknown logical axis"):
        logical_to_spec(("embedding",), "trainer")
    with pytest.raises(ValueError, match="valid roles"):
        logical_to_spec(("embed",), "critic")
