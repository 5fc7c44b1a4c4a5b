"""Weight sync: the generator's copy of the policy, filled from the trainer's by resharding.

`build_generator` builds the generator side a run (or a live move) uses: its publisher
(trainer params -> generator params), engine and scheduler, as one `Generator`. The loop calls
`generator.publisher.publish(params, version)` after each update.

Parameters move with `jax.device_put` to the generator's `NamedSharding`s, in chunks of at most
`chunk_bytes` so the extra memory held during a transfer stays bounded (each chunk is finished
before the next starts). An optional dtype cast (e.g. f32 trainer → bf16 generator) happens per
chunk on the source side. Every sync is timed and reported in bytes, seconds and GB/s.
"""

from __future__ import annotations

import dataclasses
import functools
import time
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.config import ConfigError, RunConfig
from jaxrl.distributed import local_replica
from jaxrl.generate.disaggregated import DisaggregatedEngine, split_generator_mesh
from jaxrl.generate.engine import JaxEngine
from jaxrl.generate.scheduler import Scheduler
from jaxrl.models import lora
from jaxrl.models.model import abstract_model
from jaxrl.models.quant import generator_state_fn
from jaxrl.rounding import round_up
from jaxrl.sharding import pure_state_shardings


@dataclasses.dataclass(frozen=True)
class SyncStats:
    bytes: int
    seconds: float
    chunks: int

    @property
    def gbps(self) -> float:
        return self.bytes / max(self.seconds, 1e-9) / 1e9


def _chunks(sizes: list[int], limit: int) -> list[list[int]]:
    """Group consecutive leaf indices so each group's bytes stay <= limit (one leaf may exceed)."""
    groups, current, total = [], [], 0
    for i, size in enumerate(sizes):
        if current and total + size > limit:
            groups.append(current)
            current, total = [], 0
        current.append(i)
        total += size
    if current:
        groups.append(current)
    return groups


@jax.jit
def _copy(x):
    return jnp.copy(x)


@functools.partial(jax.jit, static_argnums=1)
def _cast_all(xs, dtypes):
    # one dispatch for a whole chunk: f32 -> bf16 of the 40M benchmark model's 98 sharded leaves
    # took 30 ms leaf by leaf, 20 ms in one call (CPU, 8 simulated devices)
    return [x.astype(d) for x, d in zip(xs, dtypes, strict=True)]


class WeightSync:
    """Callable that reshards a parameter pytree onto fixed target shardings.

    `target_shardings` is a pytree of `jax.sharding.Sharding` matching the parameters (or a tree
    prefix of them). `dtype` casts floating leaves for the generator; `None` keeps dtypes.
    `gather` (multi-process runs) turns each cast leaf into a process-local copy before it moves
    (`jaxrl.distributed.local_replica`: the generator mesh is process-local).
    """

    def __init__(self, target_shardings: Any, *, dtype: Any = None, chunk_bytes: int = 1 << 28,
                 gather: Any = None):
        if chunk_bytes <= 0:
            raise ValueError(f"chunk_bytes must be > 0, got {chunk_bytes}")
        self.target_shardings = target_shardings
        self.dtype = None if dtype is None else jnp.dtype(dtype)
        self.chunk_bytes = int(chunk_bytes)
        self.gather = gather

    def _out_dtype(self, dtype):
        if self.dtype is not None and jnp.issubdtype(dtype, jnp.floating):
            return self.dtype
        return jnp.dtype(dtype)

    def _prepare(self, xs: list, shardings: list) -> list:
        """The source-side arrays of one chunk: cast (one jitted call for all cast leaves), or
        copied when the target shares devices, then gathered in multi-process runs."""
        out = list(xs)
        cast = [i for i, x in enumerate(xs) if self._out_dtype(x.dtype) != x.dtype]
        if cast:
            dtypes = tuple(self._out_dtype(xs[i].dtype) for i in cast)
            for i, y in zip(cast, _cast_all(tuple(xs[i] for i in cast), dtypes), strict=True):
                out[i] = y  # new buffers
        for i, x in enumerate(xs):
            if i in cast or self.gather is not None:
                continue
            if set(x.sharding.device_set) & set(shardings[i].device_set):
                # Shared devices (colocated meshes): device_put may return the trainer's own
                # buffer (even with may_alias=False), which the next train step donates.
                out[i] = _copy(x)
        return out if self.gather is None else [self.gather(x) for x in out]

    def __call__(self, params: Any) -> tuple[Any, SyncStats]:
        # The shardings tree may be a prefix of the params tree (e.g. one sharding per NNX
        # Variable): each sharding applies to every array below its position.
        shard_leaves, shard_def = jax.tree.flatten(
            self.target_shardings, is_leaf=lambda x: isinstance(x, jax.sharding.Sharding)
        )
        subtrees = shard_def.flatten_up_to(params)
        leaves, shardings, where = [], [], []
        for i, sub in enumerate(subtrees):
            sub_leaves, sub_def = jax.tree.flatten(sub)
            where.append((sub_def, len(sub_leaves)))
            leaves += sub_leaves
            shardings += [shard_leaves[i]] * len(sub_leaves)
        out_dtypes = [self._out_dtype(x.dtype) for x in leaves]
        sizes = [int(np.prod(x.shape)) * jnp.dtype(d).itemsize
                 for x, d in zip(leaves, out_dtypes, strict=True)]
        jax.block_until_ready(leaves)  # time the transfer, not the step that computes the params
        start = time.perf_counter()
        moved: list = [None] * len(leaves)
        groups = _chunks(sizes, self.chunk_bytes)
        for group in groups:
            targets = [shardings[i] for i in group]
            placed = jax.device_put(self._prepare([leaves[i] for i in group], targets), targets)
            jax.block_until_ready(placed)
            for i, x in zip(group, placed, strict=True):
                moved[i] = x
        stats = SyncStats(bytes=sum(sizes), seconds=time.perf_counter() - start, chunks=len(groups))
        rebuilt, k = [], 0
        for sub_def, n in where:
            rebuilt.append(jax.tree.unflatten(sub_def, moved[k : k + n]))
            k += n
        return jax.tree.unflatten(shard_def, rebuilt), stats


def _quantized(quantize, params: Any) -> tuple[Any, dict]:
    """`quantize(params)` timed (`pipeline/quantize_s`); no-op without a quantizer."""
    if quantize is None:
        return params, {}
    jax.block_until_ready(params)  # time the transform, not the step that computes the params
    start = time.perf_counter()
    params = jax.block_until_ready(quantize(params))
    return params, {"pipeline/quantize_s": time.perf_counter() - start}


class GeneratorPublisher:
    """The pipeline's `publish`: reshard trainer params with a `WeightSync`, rebuild the generator
    model's state from them (`graphdef`), and report the sync's time, bytes and bandwidth.

    `quantize` (`generate.quantize` and/or `generate.fuse_projections`): a jitted
    `params -> params` (`jaxrl.models.quant.generator_state_fn`, timed as
    `pipeline/quantize_s`), run on the generator mesh after the move, or with `before_move` on
    the trainer's devices before it, so that only the 8-bit copy crosses; `graphdef` is then the
    transformed model's. The trainer's copy keeps its precision and layout."""

    def __init__(self, sync: WeightSync, graphdef, quantize=None, *, before_move: bool = False):
        self.sync, self.graphdef, self.quantize = sync, graphdef, quantize
        self.before_move = before_move

    def publish(self, params: Any, version: int) -> tuple[Any, dict]:
        if self.before_move:
            params, extra = _quantized(self.quantize, params)
            gen_params, stats = self.sync(params)
        else:
            gen_params, stats = self.sync(params)
            gen_params, extra = _quantized(self.quantize, gen_params)
        gen_state = nnx.state(nnx.merge(self.graphdef, gen_params))
        return gen_state, {"pipeline/weight_sync_s": stats.seconds,
                           "pipeline/weight_sync_gbps": stats.gbps,
                           "pipeline/weight_sync_bytes": float(stats.bytes), **extra}


class LoraPublisher:
    """The pipeline's `publish` for a LoRA run: the generator keeps the base it received once
    and each publish moves only the adapters (`WeightSync` of the adapter tree).

    `merge=True`: a jitted `W + s A B` on the generator mesh rebuilds the targeted weights of a
    plain model (the base copy is kept: the next publish merges into it again), so decode runs
    exactly the full-parameter model's graph. `merge=False`: the generator's model carries the
    adapters and adds `s (x A) B` in its forward pass; no second copy of the targeted weights.

    `quantize` (`generate.quantize="int8"`, a jitted plain `params -> params`): with `merge`,
    each publish quantizes the merged weights; without, the base is quantized once and the
    adapters stay in the generator's dtype.
    """

    def __init__(self, base_sync: WeightSync, adapter_sync: WeightSync, graphdef, base: Any,
                 lora_cfg, *, merge: bool, merged_shardings: Any = None, quantize=None):
        self.adapter_sync, self.graphdef, self.merge = adapter_sync, graphdef, merge
        self.base, stats = base_sync(base)  # once, for the whole run
        self.base_stats = stats
        self.quantize = quantize if merge else None
        if quantize is not None and not merge:
            self.base = quantize(self.base)
        self._join = lora.join
        if merge:
            self._merge = jax.jit(lambda b, a: lora.merge(lora.join(b, a), lora_cfg),
                                  out_shardings=merged_shardings)

    def publish(self, adapters: Any, version: int) -> tuple[Any, dict]:
        gen_adapters, stats = self.adapter_sync(adapters)
        start = time.perf_counter()
        if self.merge:
            params = jax.block_until_ready(self._merge(self.base, gen_adapters))
        else:
            params = self._join(self.base, gen_adapters)
        merge_s = time.perf_counter() - start
        params, extra = _quantized(self.quantize, params)
        gen_state = nnx.state(nnx.merge(self.graphdef, params))
        return gen_state, {"pipeline/weight_sync_s": stats.seconds + merge_s,
                           "pipeline/weight_sync_gbps": stats.gbps,
                           "pipeline/weight_sync_bytes": float(stats.bytes),
                           "pipeline/lora_merge_s": merge_s, **extra}


@dataclasses.dataclass(frozen=True)
class Generator:
    """The generator side, replaced as a whole by a live move: the publisher that turns the
    trainer's params into the generator's, the engine that holds them, and its scheduler."""

    publisher: GeneratorPublisher | LoraPublisher
    engine: Any
    scheduler: Scheduler


def build_generator(cfg: RunConfig, model_cfg, mesh, trainer_params, *, seq_len: int,
                    version: int, eos_id: int | tuple[int, ...], multi: bool,
                    base=None) -> Generator:
    """The generator's copy of the model on its own mesh, in `generate.dtype`, filled from the
    trainer's params by resharding. A LoRA run passes its frozen `base` (moved once) and
    adapters as `trainer_params` (moved every publish)."""
    devices_total, prefill_mesh = mesh.size, None
    if cfg.generate.prefill_devices:  # weights published to the decode group, copied to prefill
        try:
            prefill_mesh, mesh = split_generator_mesh(mesh, cfg.generate.prefill_devices)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    gen_dtype = cfg.generate.dtype or model_cfg.param_dtype
    gen_cfg = dataclasses.replace(model_cfg, param_dtype=gen_dtype, dtype=gen_dtype)
    gather = local_replica if multi else None
    quant = None if cfg.generate.quantize == "none" else cfg.generate.quantize
    if model_cfg.lora.enabled:
        publisher, graphdef = lora_publisher(gen_cfg, mesh, base, gather, quantize=quant)
    elif quant:  # cast, fused and quantized on the trainer's devices; the 8-bit copy moves
        fuse = cfg.generate.fuse_projections
        graphdef, abstract = nnx.split(abstract_model(gen_cfg, quantize=quant, fused=fuse))
        sync = WeightSync(pure_state_shardings(abstract, mesh, "generator"), gather=gather)
        quantize = generator_state_fn(nnx.graphdef(abstract_model(gen_cfg)), quantize=quant,
                                      fuse=fuse, dtype=gen_dtype)
        publisher = GeneratorPublisher(sync, graphdef, quantize, before_move=True)
    else:
        graphdef, abstract = nnx.split(abstract_model(gen_cfg))
        targets = pure_state_shardings(abstract, mesh, "generator")
        sync = WeightSync(targets, dtype=gen_dtype, gather=gather)
        quantize, fuse = None, cfg.generate.fuse_projections
        if fuse:  # moved in generate.dtype, then fused on the generator mesh
            quantize = generator_transform(gen_cfg, mesh, graphdef, fuse=fuse)
            graphdef = nnx.graphdef(abstract_model(gen_cfg, fused=fuse))
        publisher = GeneratorPublisher(sync, graphdef, quantize)
    gen_params = publisher.publish(trainer_params, version)[0]
    kind, split = JaxEngine, {}
    if prefill_mesh is not None:
        kind, split = DisaggregatedEngine, dict(prefill_mesh=prefill_mesh)
    engine = kind(nnx.merge(graphdef, gen_params),
                  num_slots=round_up(cfg.generate.num_slots, mesh.shape["dp"]),
                  max_len=cfg.generate.kv_len(seq_len),
                  mesh=mesh, chunk_steps=cfg.generate.chunk_steps,
                  eos_ids=tuple(np.atleast_1d(eos_id).tolist()),
                  version=version, kv_layout=cfg.generate.kv_layout,
                  page_size=cfg.generate.page_size,
                  debug_delay_s=cfg.generate.debug_chunk_delay_s / devices_total, **split)
    return Generator(publisher, engine, Scheduler(engine))


def generator_transform(gen_cfg, mesh, plain_graphdef, *, quantize: str | None = None,
                        fuse: bool = False):
    """The jitted `params -> params` of the generator's own copy, on the generator mesh:
    `plain_graphdef`'s model (no adapters) with its projections fused
    (`generate.fuse_projections`) and/or quantized to the format `quantize`
    (`generate.quantize`: "int8", "w8a8", "fp8"; None: not quantized), laid out as the
    transformed model's shardings (`jaxrl.models.quant.generator_state_fn`)."""
    plain_cfg = dataclasses.replace(gen_cfg, lora=type(gen_cfg.lora)())
    abstract = nnx.state(abstract_model(plain_cfg, quantize=quantize, fused=fuse))
    return generator_state_fn(plain_graphdef, pure_state_shardings(abstract, mesh, "generator"),
                              quantize=quantize, fuse=fuse)


def lora_publisher(gen_cfg, mesh, base, gather, *, quantize: str | None = None):
    """(LoraPublisher, the generator model's graphdef) for a LoRA run: the base moved once in
    the generator's dtype; adapters every publish, then merged into a plain model on the
    generator mesh (`model.lora.generator="merge"`) or applied in its forward pass.
    `quantize` (a `generate.quantize` format, None: off): the merged weights (or, in the forward
    pass, the base once) quantized to it."""
    lora_cfg = gen_cfg.lora
    merge = lora_cfg.generator == "merge"
    _, abstract = nnx.split(abstract_model(gen_cfg))
    base_targets, adapter_targets = lora.split(pure_state_shardings(abstract, mesh, "generator"))
    plain_cfg = dataclasses.replace(gen_cfg, lora=type(lora_cfg)())
    graphdef = nnx.graphdef(abstract_model(plain_cfg if merge else gen_cfg, quantize=quantize))
    if quantize is not None:
        quantize = generator_transform(gen_cfg, mesh, nnx.graphdef(abstract_model(plain_cfg)),
                                       quantize=quantize)
    # adapters stay f32 to be merged (the sum is rounded once); cast when applied per token
    adapter_sync = WeightSync(adapter_targets, dtype=None if merge else gen_cfg.dtype,
                              gather=gather)
    base_sync = WeightSync(base_targets, dtype=gen_cfg.param_dtype, gather=gather)
    publisher = LoraPublisher(base_sync, adapter_sync, graphdef, base, lora_cfg, merge=merge,
                              merged_shardings=base_targets, quantize=quantize)
    return publisher, graphdef
