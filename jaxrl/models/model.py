"""Creating a model sharded on a mesh without ever materialising it whole on one device."""

from __future__ import annotations

import jax
from flax import nnx
from jax.sharding import Mesh

from jaxrl.config import ModelConfig
from jaxrl.models.transformer import Transformer
from jaxrl.sharding import Role, state_shardings


def abstract_model(cfg: ModelConfig, seed: int = 0, *, quantize: str | None = None,
                   fused: bool = False) -> Transformer:
    """The model with `ShapeDtypeStruct` leaves (no memory allocated); the generator's copy
    with `fused` projections (`Transformer.fuse_projections`) and/or 8-bit ones in the format
    `quantize` (`Transformer.quantize`: "int8", "w8a8", "fp8")."""

    def build():
        model = Transformer(cfg, rngs=nnx.Rngs(seed))
        if fused:
            model.fuse_projections()
        return model if quantize is None else model.quantize(quantize)

    return nnx.eval_shape(build)


def create_model(
    cfg: ModelConfig, *, mesh: Mesh | None = None, role: Role = "trainer", seed: int = 0
) -> Transformer:
    """Randomly initialised model; with a mesh, every parameter is created already sharded.

    Abstract shapes (`nnx.eval_shape`) give the shardings, and a jitted init with those
    `out_shardings` materialises each shard on its own device.
    """
    if mesh is None:
        return Transformer(cfg, rngs=nnx.Rngs(seed))
    graphdef, abstract_state = nnx.split(abstract_model(cfg, seed))
    shardings = state_shardings(abstract_state, mesh, role)

    def init():
        return nnx.state(Transformer(cfg, rngs=nnx.Rngs(seed)))

    state = jax.jit(init, out_shardings=shardings)()
    return nnx.merge(graphdef, state)


def place_model(model: Transformer, mesh: Mesh, role: Role) -> Transformer:
    """Reshard an existing model's parameters onto `mesh` for `role`."""
    graphdef, state = nnx.split(model)
    return nnx.merge(graphdef, jax.device_put(state, state_shardings(state, mesh, role)))


def param_count(model: Transformer) -> int:
    return sum(x.size for x in jax.tree.leaves(nnx.state(model, nnx.Param)))
