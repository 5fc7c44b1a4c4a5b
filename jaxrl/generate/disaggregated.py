"""Prefill/decode disaggregation: prefill on one group of the generator's devices, decode on the
rest, the KV cache moving between them by resharding.

`split_generator_mesh(mesh, prefill_devices)` cuts a generator mesh (`dp` x `tp`) into two
meshes of whole `dp` rows: the first `prefill_devices / tp` rows prefill, the others decode.
`DisaggregatedEngine` is a `JaxEngine` on the decode mesh (its decode state, `insert`,
`generate_chunk` and `release` are the parent's) that keeps a second copy of the weights on the
prefill mesh, in a one-slot `JaxEngine` used only for `prefill`. Each `Prefix` is computed
there, then `jax.device_put` to the decode mesh (cache rows' kv heads over `tp`, replicated over
`dp`; the rest replicated) before `insert` reads it. `set_params` updates both copies.

Every prefill records its transfer: the host waits for the prefix, then times the move until it
has landed (`last_kv_transfer`, and the totals `kv_transfers`, `kv_transfer_s`,
`kv_transfer_bytes`; the scheduler reports them as `gen/kv_transfer_s` and
`gen/kv_transfer_bytes` per prefill). Bytes are the prefix's own (cache row, logits, scalars),
not multiplied by the decode replicas that each receive a copy.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.generate.engine import JaxEngine, Prefix, Weights
from jaxrl.models.transformer import KVCache
from jaxrl.sharding import MESH_AXES, logical_sharding


def split_generator_mesh(mesh: Mesh, prefill_devices: int) -> tuple[Mesh, Mesh]:
    """(prefill mesh, decode mesh) from a generator mesh: the first `prefill_devices` devices
    (whole `dp` rows, each `tp` devices) prefill, the remaining ones decode. Both keep the
    mesh's `tp`."""
    if tuple(mesh.axis_names) != MESH_AXES["generator"]:
        raise ValueError(f"split_generator_mesh: expected a generator mesh with axes "
                         f"{MESH_AXES['generator']}, got {tuple(mesh.axis_names)}")
    n, tp = mesh.size, mesh.shape["tp"]
    valid = list(range(tp, n, tp))
    if prefill_devices not in valid:
        raise ValueError(
            f"generate.prefill_devices={prefill_devices!r} does not split the generator mesh "
            f"{tuple(mesh.devices.shape)} ({n} devices, tp={tp}); valid: {valid or 'none'} "
            "(a multiple of tp, leaving at least one tp group to decode), or 0 for colocated "
            "prefill and decode")
    rows = prefill_devices // tp
    axes = MESH_AXES["generator"]
    return Mesh(mesh.devices[:rows], axes), Mesh(mesh.devices[rows:], axes)


def decode_mesh_shape(generator_shape: Sequence[int], prefill_devices: int) -> tuple[int, int]:
    """The decode group's (dp, tp) in a generator mesh of `generator_shape` split by
    `split_generator_mesh` (the whole shape when `prefill_devices` is 0 or does not split it:
    `split_generator_mesh` reports that)."""
    dp, tp = (int(s) for s in generator_shape)
    rows, rest = divmod(prefill_devices, tp)
    return (dp - rows, tp) if prefill_devices and not rest and 0 < rows < dp else (dp, tp)


class DisaggregatedEngine(JaxEngine):
    """A `JaxEngine` whose prefill runs on a separate mesh with its own copy of the weights.

    Args:
      model: the `Transformer` (copied onto both meshes).
      prefill_mesh: the prefill group's generator mesh.
      mesh: the decode group's generator mesh (devices disjoint from `prefill_mesh`).
      **kwargs: the other `JaxEngine` arguments (num_slots, max_len, chunk_steps, ...), for the
        decode side; the prefill side shares its buckets, stop ids and version.
    """

    batched_prefill = False  # prefixes move one at a time (timed per request)

    def __init__(self, model, *, prefill_mesh: Mesh, mesh: Mesh, **kwargs):
        if prefill_mesh is None or mesh is None:
            raise ValueError("DisaggregatedEngine: needs both prefill_mesh and mesh (decode)")
        shared = set(prefill_mesh.devices.flat) & set(mesh.devices.flat)
        if shared:
            raise ValueError(f"DisaggregatedEngine: the prefill and decode meshes share devices "
                             f"{sorted(d.id for d in shared)}; give them disjoint devices")
        super().__init__(model, mesh=mesh, **kwargs)
        self.prefill_engine = JaxEngine(
            model, num_slots=1, max_len=self.max_len, mesh=prefill_mesh,
            prefill_buckets=self.prefill_buckets, eos_ids=self.eos_ids,
            max_stop_ids=self.max_stop_ids, version=kwargs.get("version", 0))
        self.prefill_mesh = prefill_mesh
        self.last_kv_transfer: tuple[float, int] | None = None  # (seconds, bytes)
        self.kv_transfers, self.kv_transfer_s, self.kv_transfer_bytes = 0, 0.0, 0

    def set_params(self, params, version: int) -> None:
        """Both groups' weights: checked and placed on the decode mesh, then on the prefill
        mesh (a device-to-device copy of the decode group's)."""
        super().set_params(params, version)
        # an engine on CPU holds its own layout (`out_in`): the prefill group makes its copy
        self.prefill_engine.set_params(params if self.out_in else self.params.state, version)

    def release_params(self) -> None:
        super().release_params()
        self.prefill_engine.release_params()

    def prefill(self, params: Weights, tokens: Sequence[int], true_length: int | None = None,
                **kwargs) -> Prefix:
        """Prefill on the prefill mesh, then move the prefix to the decode mesh. `params` is
        `self.params` (the prefill group's copy of the same version is used) or other weights,
        which are first placed on the prefill mesh."""
        pre = self.prefill_engine
        if params is self.params:
            params = pre.params
        else:
            params = Weights(state=jax.device_put(params.state, pre._param_shardings),
                             version=jax.device_put(params.version, NamedSharding(
                                 self.prefill_mesh, PartitionSpec())))
        prefix = jax.block_until_ready(pre.prefill(params, tokens, true_length, **kwargs))
        start = time.perf_counter()
        moved = jax.block_until_ready(jax.device_put(prefix, self.prefix_shardings(prefix)))
        seconds = time.perf_counter() - start
        nbytes = sum(x.nbytes for x in jax.tree.leaves(prefix))
        self.last_kv_transfer = (seconds, nbytes)
        self.kv_transfers += 1
        self.kv_transfer_s += seconds
        self.kv_transfer_bytes += nbytes
        return moved

    def prefix_shardings(self, prefix: Prefix):
        """Where a prefix lives on the decode mesh: cache rows as the decode state's cache
        (`KVCache.logical_axes`; one row is replicated over `dp`), everything else replicated."""
        def shard(path, x):
            if which := {getattr(p, "name", None) for p in path} & {"k", "v"}:
                axes = KVCache.logical_axes(*which, prefix.cache.heads_major)
                return logical_sharding(self.mesh, "generator", axes, x.shape)
            return NamedSharding(self.mesh, PartitionSpec())
        return jax.tree_util.tree_map_with_path(shard, prefix)
