"""Meshes per role, and the ONE table from logical axis names to mesh axes.

Model code names logical axes only (`embed`, `vocab`, `heads`, ...). This module is the only
place that knows mesh axis names: the trainer mesh has axes (`fsdp`, `tp`), the generator mesh
(`dp`, `tp`).
A logical axis whose size does not divide evenly over its mesh axis is replicated instead.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from typing import Literal

import jax
import numpy as np
from flax import nnx
from jax.sharding import AbstractMesh, Mesh, NamedSharding, PartitionSpec

from jaxrl import cpu
from jaxrl.config import ConfigError, MeshConfig

Role = Literal["trainer", "generator"]
ROLES: tuple[str, ...] = ("trainer", "generator")
MESH_AXES: dict[str, tuple[str, str]] = {"trainer": ("fsdp", "tp"), "generator": ("dp", "tp")}

# Logical axis -> mesh axis, per role. `None` means replicated.
#   trainer: FSDP shards parameters along `embed` and the batch along `batch`;
#            TP shards heads / mlp / vocab.
#   generator: parameters are replicated over `dp` (each replica serves its own slots) and
#              split by TP; KV-cache slots (`cache_batch`) and decode batches are split over `dp`.
#   expert (the leading axis of a mixture of experts' stacked expert weights): over `fsdp` on
#            the trainer (expert parallelism on the data axis, which already shards the tokens;
#            `embed` then stays whole in those weights, as a mesh axis shards one dimension),
#            over `tp` on the generator (each tp shard holds whole experts, `mlp` stays whole).
LOGICAL_AXIS_RULES: dict[str, dict[str, str | None]] = {
    "trainer": {
        "batch": "fsdp",
        "cache_batch": "fsdp",
        "length": None,
        "embed": "fsdp",
        "vocab": "tp",
        "heads": "tp",
        "kv_heads": "tp",
        "head_dim": None,
        "mlp": "tp",
        "norm": None,
        "layers": None,
        "lora_rank": None,
        "expert": "fsdp",
    },
    "generator": {
        "batch": "dp",
        "cache_batch": "dp",
        "length": None,
        "embed": None,
        "vocab": "tp",
        "heads": "tp",
        "kv_heads": "tp",
        "head_dim": None,
        "mlp": "tp",
        "norm": None,
        "layers": None,
        "lora_rank": None,
        "expert": "tp",
    },
}


@dataclasses.dataclass(frozen=True)
class Meshes:
    trainer: Mesh
    generator: Mesh

    @property
    def colocated(self) -> bool:
        return set(self.trainer.devices.flat) == set(self.generator.devices.flat)


def _check_role(role: str) -> None:
    if role not in ROLES:
        raise ValueError(f"unknown role {role!r}; valid roles: {list(ROLES)}")


def mesh_role(mesh: Mesh | AbstractMesh) -> Role | None:
    """The role whose mesh axes `mesh` (concrete or abstract) has, or None for another mesh."""
    for role, axes in MESH_AXES.items():
        if tuple(mesh.axis_names) == axes:
            return role
    return None


def make_mesh(shape: Sequence[int], role: Role, devices: Sequence[jax.Device]) -> Mesh:
    _check_role(role)
    need = int(np.prod(shape))
    if need != len(devices):
        raise ConfigError(
            f"{role} mesh {tuple(shape)} needs {need} devices, {len(devices)} were given to it"
        )
    return Mesh(np.asarray(devices, dtype=object).reshape(tuple(shape)), MESH_AXES[role])


def resolve_mesh_shapes(
    cfg: MeshConfig, num_devices: int
) -> tuple[tuple[int, int], tuple[int, int]]:
    """Fill in automatic mesh shapes for `num_devices` devices."""
    trainer, generator = cfg.trainer, cfg.generator
    colocated = cfg.colocated or num_devices == 1
    if colocated:
        trainer = trainer or generator or (num_devices, 1)
        generator = generator or trainer
    else:
        half = num_devices // 2
        if trainer is None and generator is None:
            trainer, generator = (half, 1), (num_devices - half, 1)
        elif trainer is None:
            trainer = (num_devices - int(np.prod(generator)), 1)
        elif generator is None:
            generator = (num_devices - int(np.prod(trainer)), 1)
    return tuple(int(s) for s in trainer), tuple(int(s) for s in generator)


def make_meshes(cfg: MeshConfig, devices: Sequence[jax.Device] | None = None) -> Meshes:
    """Build the trainer and generator meshes from disjoint slices of `devices`.

    Fails before any work when the requested meshes need more devices than there are.
    """
    devices = list(jax.devices() if devices is None else devices)
    n = len(devices)
    trainer, generator = resolve_mesh_shapes(cfg, n)
    nt, ng = int(np.prod(trainer)), int(np.prod(generator))
    if min(trainer + generator) < 1:
        raise ConfigError(
            f"mesh does not fit: {n} device(s) available, trainer {trainer} + generator {generator}"
        )
    if cfg.colocated or n == 1:
        if devices[0].platform == "cpu":
            cpu.role_devices("shared", nt, ng)  # undo an earlier run's pinning
        if max(nt, ng) > n:
            raise ConfigError(
                f"mesh does not fit: {n} device(s) available, colocated trainer {trainer} "
                f"({nt}) / generator {generator} ({ng}) requested"
            )
        return Meshes(
            trainer=make_mesh(trainer, "trainer", devices[:nt]),
            generator=make_mesh(generator, "generator", devices[:ng]),
        )
    if nt + ng > n:
        raise ConfigError(
            f"mesh does not fit: {n} device(s) available, {nt + ng} requested "
            f"(trainer {trainer} = {nt}, generator {generator} = {ng}); "
            f"shrink the meshes or set --mesh.colocated=true"
        )
    generator_devices = devices[nt : nt + ng]
    if devices[0].platform == "cpu":
        try:
            own = cpu.role_devices(cfg.cpu_cores, nt, ng)
        except ValueError as e:
            raise ConfigError(str(e)) from None
        generator_devices = own or generator_devices
    return Meshes(
        trainer=make_mesh(trainer, "trainer", devices[:nt]),
        generator=make_mesh(generator, "generator", generator_devices),
    )


def logical_to_spec(
    logical_axes: Sequence[str | None], role: Role, mesh: Mesh | AbstractMesh | None = None,
    shape: Sequence[int] | None = None,
) -> PartitionSpec:
    """Map logical axis names to a PartitionSpec; replicate dims that do not divide evenly."""
    _check_role(role)
    rules = LOGICAL_AXIS_RULES[role]
    spec, used = [], set()
    for i, name in enumerate(logical_axes):
        if name is not None and name not in rules:
            raise ValueError(f"unknown logical axis {name!r}; known: {sorted(rules)}")
        axis = rules.get(name) if name is not None else None
        if axis is not None and axis in used:
            axis = None  # a mesh axis may shard only one dimension
        if axis is not None and mesh is not None and shape is not None:
            if shape[i] % mesh.shape[axis]:
                axis = None
        if axis is not None:
            used.add(axis)
        spec.append(axis)
    return PartitionSpec(*spec)


def logical_sharding(
    mesh: Mesh, role: Role, logical_axes: Sequence[str | None], shape: Sequence[int] | None = None
) -> NamedSharding:
    """NamedSharding for an array with the given logical axes (and shape, for divisibility)."""
    return NamedSharding(mesh, logical_to_spec(logical_axes, role, mesh, shape))


def _variable_sharding(v: nnx.Variable, mesh: Mesh, role: Role) -> NamedSharding:
    axes = v.get_metadata().get("logical_axes")
    value = v.get_value() if hasattr(v, "get_value") else v.value
    shape = getattr(value, "shape", ())
    if axes is None:
        axes = (None,) * len(shape)
    return logical_sharding(mesh, role, axes, shape)


def state_shardings(state: nnx.State, mesh: Mesh, role: Role):
    """A pytree of NamedShardings matching an NNX state (abstract or concrete)."""
    return jax.tree.map(
        lambda v: _variable_sharding(v, mesh, role),
        state,
        is_leaf=lambda x: isinstance(x, nnx.Variable),
    )


def pure_state_shardings(state: nnx.State, mesh: Mesh, role: Role) -> dict:
    """`state_shardings` as a nested plain dict (the layout of `nnx.State.to_pure_dict()`): the
    target tree for moving pure parameter dicts, e.g. `WeightSync`."""
    out: dict = {}
    for path, sharding in state_shardings(state, mesh, role).flat_state():
        node = out
        for key in path[:-1]:
            node = node.setdefault(key, {})
        node[path[-1]] = sharding
    return out

