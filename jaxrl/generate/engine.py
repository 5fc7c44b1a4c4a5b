"""The generation engine: JetStream-shaped `prefill` / `insert` / `generate` over decode slots.

A decode state holds `num_slots` slots, each with its own KV-cache row (`[slots, max_len, K, D]`
per layer, slots sharded over the generator mesh's `dp`, kv heads over `tp`), last token, sampling
parameters, stop ids, token budget and minimum length. One prompt is prefilled once into a
one-row cache (`prefill`); each of its `n` samples is then copied into a free slot (`insert`),
which draws the sample's first token from the prefill logits with the sample's own key.
`generate_chunk` runs up to `chunk_steps` decode steps in one jitted `lax.while_loop`, writing
every emitted token, its behaviour log-probability and the policy version of the weights into
fixed-size buffers; the host reads them once per chunk (the scheduler in
`jaxrl.generate.scheduler` does this).

Shapes never depend on a request: prompts are padded to a bucket (powers of two up to
`max_len`), the decode state is fixed, and `set_params` swaps weights of the same structure and
sharding without recompiling. `kv_layout="paged"` swaps the decode state's `KVCache` for a
`jaxrl.models.paged.PagedKVCache` (page pools + page table, paged decode attention) behind the
same interface: prefill still fills a contiguous one-row prefix, `insert` writes it into the
slot's pages, and decode steps write and read through the page table. In either layout a
sliding-window layer whose window is shorter than `max_len` keeps only its window per slot (a
ring buffer, `jaxrl.models.kv_cache`): `insert` copies the prompt's last window positions in.

A mixture of experts records its routing (for routing replay, `train.routing_replay`): the
prefix holds the experts each sparse layer chose for every prompt token, and each chunk's
`StepResult.experts_CBLK` those chosen for the token each slot fed at each step (the token it
emitted one row before), in the smallest integer dtype that holds them (`moe.experts_dtype`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import time
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.generate.sampling import ban_stop_ids, sample_key, sample_tokens
from jaxrl.generate.state import (  # noqa: F401 (re-exported: the engine's types live there)
    FINISH_LENGTH,
    FINISH_NONE,
    FINISH_REASONS,
    FINISH_STOP,
    KV_LAYOUTS,
    DecodeState,
    Engine,
    Prefix,
    SlotParams,
    StepResult,
    Weights,
)
from jaxrl.models import lowp_dots
from jaxrl.models.moe import experts_dtype, num_sparse_layers
from jaxrl.models.paged import PagedKVCache
from jaxrl.models.transformer import DTYPES, KVCache, Transformer, prompt_rope_tables, table_rope
from jaxrl.rounding import power_of_two_parts
from jaxrl.sharding import logical_sharding, state_shardings

MIN_BUCKET = 16  # the smallest prefill bucket


def default_buckets(max_len: int, smallest: int = MIN_BUCKET) -> tuple[int, ...]:
    """Powers of two from `smallest` below `max_len`, then `max_len` itself."""
    out, b = [], smallest
    while b < max_len:
        out.append(b)
        b *= 2
    return tuple(out) + (max_len,)


class JaxEngine:
    """The `Engine` for jaxrl's `Transformer`, optionally on a generator mesh.

    Args:
      model: a `Transformer` (its parameters become version `version`).
      num_slots: concurrent samples (decode batch size).
      max_len: KV-cache length per slot; a request needs prompt + max_tokens <= max_len.
      mesh: the generator mesh (`dp` x `tp`); None runs on the default device.
      chunk_steps: decode steps per host round trip.
      prefill_buckets: allowed padded prompt lengths (default: powers of two, then max_len).
      eos_ids: token ids that stop every request.
      max_stop_ids: room for per-request stop ids (EOS ids included).
      kv_layout: "contiguous" (a `[slots, max_len]` cache row per slot) or "paged" (a
        `PagedKVCache`: pages of `page_size` positions, static allocation per slot).
      page_size: positions per page when `kv_layout="paged"`.
      debug_delay_s: for tests and benchmarks only: seconds each `generate_chunk` sleeps, an
        artificially slow generator (`generate.debug_chunk_delay_s`); 0 = none.
    """

    def __init__(self, model: Transformer, *, num_slots: int, max_len: int,
                 mesh: Mesh | None = None, chunk_steps: int = 16,
                 prefill_buckets: Sequence[int] | None = None, eos_ids: Sequence[int] = (),
                 max_stop_ids: int = 8, version: int = 0, kv_layout: str = "contiguous",
                 page_size: int = 16, debug_delay_s: float = 0.0):
        if not debug_delay_s >= 0:
            raise ValueError(f"JaxEngine: debug_delay_s must be >= 0, got {debug_delay_s!r}")
        self.debug_delay_s = float(debug_delay_s)
        for name, value in (("num_slots", num_slots), ("max_len", max_len),
                            ("chunk_steps", chunk_steps), ("max_stop_ids", max_stop_ids),
                            ("page_size", page_size)):
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"JaxEngine: {name} must be an integer >= 1, got {value!r}")
        if kv_layout not in KV_LAYOUTS:
            raise ValueError(f"JaxEngine: invalid kv_layout {kv_layout!r}; valid choices: "
                             f"{list(KV_LAYOUTS)}")
        self.kv_layout, self.page_size = kv_layout, page_size
        self.cfg = model.cfg
        self.num_slots, self.max_len, self.chunk_steps = num_slots, max_len, chunk_steps
        self.mesh, self.max_stop_ids = mesh, max_stop_ids
        self.eos_ids = tuple(int(t) for t in eos_ids)
        self.check_token_ids(self.eos_ids, "eos_ids")
        if len(self.eos_ids) > max_stop_ids:
            raise ValueError(f"JaxEngine: {len(self.eos_ids)} eos_ids exceed max_stop_ids "
                             f"({max_stop_ids})")
        buckets = sorted(set(prefill_buckets or default_buckets(max_len)))
        if buckets[0] < 1 or buckets[-1] > max_len:
            raise ValueError(f"JaxEngine: prefill_buckets must lie in [1, max_len={max_len}], "
                             f"got {buckets}")
        self.prefill_buckets = tuple(buckets)
        self.prefill_shapes: set[tuple[int, int]] = set()  # (rows, bucket) called, `precompile`
        self.graphdef, state = nnx.split(model)
        # bf16 dots with f32 results on CPU (jaxrl/models/lowp_dots.py); GPU/TPU lower as before
        self.wide_dots = self._platform() == "cpu"
        # and, with 2-byte weights, the projections held [out, in] (`Transformer.hold_out_in`):
        # the engine's own copy, made from the caller's layout here and in `set_params`
        self.out_in = (self.wide_dots and not self.cfg.lora.enabled
                       and jnp.dtype(DTYPES[self.cfg.dtype]) in lowp_dots.LOW_PRECISION)
        if self.out_in:
            source = self.graphdef
            self._source_like = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype),
                                             state)
            self.graphdef, state = nnx.split(nnx.merge(source, state).hold_out_in())
            self._hold = jax.jit(lambda st: nnx.state(nnx.merge(source, st).hold_out_in()))
        self._param_shardings = None
        if mesh is not None:
            self._param_shardings = state_shardings(state, mesh, "generator")
            state = jax.device_put(state, self._param_shardings)
        self.params = Weights(state=state, version=self._version(version))
        self._state_shardings = self._decode_state_shardings()
        self._init_state_fn = None
        self._prefill_fn = jax.jit(self._traced(self._prefill_impl))
        self._prefill_rows_fn = jax.jit(self._traced(self._prefill_rows_impl))
        insert_kw, chunk_kw = {}, {}
        if mesh is not None:  # keep the decode state's layout fixed across calls
            insert_kw = dict(out_shardings=self._state_shardings)
            chunk_kw = dict(out_shardings=(self._state_shardings, None))
        self._insert_fn = jax.jit(self._insert_impl, donate_argnums=(1,), **insert_kw)
        self._release_fn = jax.jit(self._release_impl, donate_argnums=(0,), **insert_kw)
        self._chunk_fns = {
            n: jax.jit(self._traced(functools.partial(self._chunk_impl, num_steps=n)),
                       donate_argnums=(1,), **chunk_kw)
            for n in (1, chunk_steps)
        }

    def _platform(self) -> str:
        """The platform of the devices the engine's steps run on."""
        devices = self.mesh.devices.flat if self.mesh is not None else jax.devices()
        return next(iter(devices)).platform

    def _traced(self, fn):
        """`fn` traced in `lowp_dots.wide_results` (the CPU kernels too on one device)."""
        kernels = self.mesh is None or self.mesh.size == 1

        def traced(*args, **kwargs):
            with lowp_dots.wide_results(self.wide_dots, kernels=kernels):
                return fn(*args, **kwargs)
        traced.__name__ = getattr(fn, "__name__", None) or fn.func.__name__  # jit's name
        return traced

    @classmethod
    def from_config(cls, model: Transformer, gen_cfg, *, max_len: int | None = None,
                    mesh: Mesh | None = None, eos_ids: Sequence[int] = (),
                    version: int = 0) -> JaxEngine:
        """An engine from a `GenerateConfig`; `max_len` is used when `gen_cfg.max_len` is 0.
        `generate.debug_chunk_delay_s` is split evenly among the mesh's devices."""
        length = gen_cfg.max_len or max_len
        if not length:
            raise ValueError("generate.max_len is 0 (automatic): pass max_len= (longest prompt "
                             "+ max new tokens)")
        return cls(model, num_slots=gen_cfg.num_slots, max_len=length, mesh=mesh,
                   chunk_steps=gen_cfg.chunk_steps, eos_ids=eos_ids, version=version,
                   kv_layout=gen_cfg.kv_layout, page_size=gen_cfg.page_size,
                   debug_delay_s=gen_cfg.debug_chunk_delay_s / (mesh.size if mesh else 1))

    # ------------------------------------------------------------------ host-side helpers

    def check_token_ids(self, ids: Sequence[int], what: str) -> None:
        bad = [t for t in ids if not 0 <= int(t) < self.cfg.vocab_size]
        if bad:
            raise ValueError(f"{what}: token ids {bad} are outside the vocabulary "
                             f"[0, {self.cfg.vocab_size})")

    def bucket_for(self, length: int) -> int:
        for b in self.prefill_buckets:
            if b >= length:
                return b
        raise ValueError(f"prompt of {length} tokens does not fit the KV cache "
                         f"(max_len={self.max_len}, largest bucket {self.prefill_buckets[-1]})")

    def check_request(self, prompt: Sequence[int], max_tokens: int,
                      stop_token_ids: Sequence[int] = ()) -> None:
        """Reject a request that cannot be served exactly (never truncate silently)."""
        if len(prompt) == 0:
            raise ValueError("empty prompt: a prompt needs at least one token")
        self.check_token_ids(prompt, "prompt")
        self.check_token_ids(stop_token_ids, "stop_token_ids")
        if len(prompt) + max_tokens > self.max_len:
            raise ValueError(
                f"request does not fit the KV cache: prompt {len(prompt)} + max_tokens "
                f"{max_tokens} = {len(prompt) + max_tokens} > max_len {self.max_len} (a run sizes "
                f"it from its held-out prompts; set generate.max_len for longer ones)"
            )
        stops = set(stop_token_ids) | set(self.eos_ids)
        if len(stops) > self.max_stop_ids:
            raise ValueError(f"{len(stops)} stop ids (EOS included) exceed max_stop_ids "
                             f"({self.max_stop_ids}) of this engine")

    def slot_params(self, *, key_data, sample_index: int, temperature: float, top_k: int,
                    top_p: float, max_tokens: int, stop_token_ids: Sequence[int],
                    min_tokens: int = 0, ignore_eos: bool = False) -> SlotParams:
        """A sample's settings; `ignore_eos` leaves the engine's EOS ids out of its stop ids,
        `min_tokens` bans its stop ids from its first tokens (see `SamplingParams`)."""
        stops = set(int(t) for t in stop_token_ids) | (set() if ignore_eos else set(self.eos_ids))
        stops = sorted(stops)
        stop_ids = np.full((self.max_stop_ids,), -1, np.int32)
        stop_ids[: len(stops)] = stops
        return SlotParams(
            key_data=np.asarray(key_data, np.uint32), sample_index=np.int32(sample_index),
            temperature=np.float32(temperature), top_k=np.int32(top_k), top_p=np.float32(top_p),
            max_tokens=np.int32(max_tokens), stop_ids=stop_ids, min_tokens=np.int32(min_tokens))

    def _version(self, version: int) -> jax.Array:
        """The version scalar, replicated on the generator mesh (which may exclude device 0)."""
        value = np.int32(version)
        if self.mesh is None:
            return jnp.asarray(value)
        return jax.device_put(value, NamedSharding(self.mesh, PartitionSpec()))

    def _decode_state_shardings(self):
        if self.mesh is None:
            return None
        abstract = jax.eval_shape(self._empty_state)
        slot_axes = lambda x: ("cache_batch",) + (None,) * (x.ndim - 1)
        def shard(path, x):
            names = {getattr(p, "name", None) for p in path}
            if names & {"k", "v"}:
                axes = KVCache.logical_axes(*(names & {"k", "v"}), abstract.cache.heads_major)
            elif names & {"k_pages", "v_pages"}:
                axes = PagedKVCache.LOGICAL_AXES
            else:  # per-slot arrays, the page table included
                axes = slot_axes(x)
            return logical_sharding(self.mesh, "generator", axes, x.shape)
        return jax.tree_util.tree_map_with_path(shard, abstract)

    def _empty_cache(self) -> KVCache | PagedKVCache:
        # sliding layers keep only their window (a ring; kv_cache.py, paged.py)
        if self.kv_layout == "paged":
            return PagedKVCache.init(self.cfg, self.num_slots, self.max_len, self.page_size,
                                     ring=True)
        return KVCache.init(self.cfg, self.num_slots, self.max_len, ring=True)

    def _empty_state(self) -> DecodeState:
        b = self.num_slots
        zeros_i = lambda: jnp.zeros((b,), jnp.int32)
        return DecodeState(
            cache=self._empty_cache(), tokens_B=zeros_i(),
            active_B=jnp.zeros((b,), bool), num_generated_B=zeros_i(), max_tokens_B=zeros_i(),
            finish_reason_B=zeros_i(), key_data_B2=jnp.zeros((b, 2), jnp.uint32),
            temperature_B=jnp.ones((b,), jnp.float32), top_k_B=zeros_i(),
            top_p_B=jnp.ones((b,), jnp.float32),
            stop_ids_BS=jnp.full((b, self.max_stop_ids), -1, jnp.int32), min_tokens_B=zeros_i(),
            pending_B=jnp.zeros((b,), bool), pending_logprob_B=jnp.zeros((b,), jnp.float32),
            pending_version_B=zeros_i(),
        )

    # ------------------------------------------------------------------ Engine interface

    def init_decode_state(self) -> DecodeState:
        """Empty slots, already laid out on the generator mesh (compiled once: a `sync` run
        makes a new state for every batch, `Scheduler.release`)."""
        if self._init_state_fn is None:
            kw = {} if self.mesh is None else dict(out_shardings=self._state_shardings)
            self._init_state_fn = jax.jit(self._empty_state, **kw)
        return self._init_state_fn()

    def set_params(self, params, version: int) -> None:
        """Swap in new weights (same structure, shapes and dtypes) without recompiling.

        `params` is an `nnx.State` of the model (or the model itself). Leaves are placed on the
        generator shardings; leaves already there are not copied.
        """
        if isinstance(params, nnx.Module):
            params = nnx.state(params)
        if self.out_in:  # the caller's layout, then the engine's own (`hold_out_in`)
            old = self._source_like
        else:
            old = self.params.state if self.params is not None else self._released_like
        if jax.tree.structure(params) != jax.tree.structure(old):
            paths = lambda t: {jax.tree_util.keystr(p) for p, _ in
                               jax.tree_util.tree_leaves_with_path(t)}
            missing, extra = paths(old) - paths(params), paths(params) - paths(old)
            raise ValueError("set_params: parameter tree differs from the engine's model; "
                             f"missing {sorted(missing)[:5]}, unexpected {sorted(extra)[:5]}")
        for (path, new), o in zip(jax.tree_util.tree_leaves_with_path(params),
                                  jax.tree.leaves(old), strict=True):
            if new.shape != o.shape or new.dtype != o.dtype:
                raise ValueError(
                    f"set_params: {jax.tree_util.keystr(path)} has {new.dtype}{list(new.shape)}, "
                    f"the engine's model has {o.dtype}{list(o.shape)}"
                )
        if self.out_in:
            params = self._hold(params)
        if self._param_shardings is not None:
            params = jax.device_put(params, self._param_shardings)
        self.params = Weights(state=params, version=self._version(version))

    def release_params(self) -> None:
        """Drop the weights, and so their memory, until the next `set_params` (which checks
        new weights against their shapes as before): a `sync` run's generator while the trainer
        updates, when it has nothing to decode."""
        if self.params is not None:
            self._released_like = jax.tree.map(
                lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.params.state)
        self.params = None

    def prefill(self, params: Weights, tokens: Sequence[int], true_length: int | None = None
                ) -> Prefix:
        """KV cache and next-token logits for one prompt (padded to its bucket)."""
        true_length = len(tokens) if true_length is None else int(true_length)
        if true_length < 1 or true_length > len(tokens):
            raise ValueError(f"prefill: true_length {true_length} must be in [1, {len(tokens)}]")
        bucket = self.bucket_for(true_length)
        padded = np.zeros((1, bucket), np.int32)
        padded[0, :true_length] = np.asarray(tokens[:true_length], np.int32)
        self.prefill_shapes.add((1, bucket))
        with self.mesh_context(params):
            return self._prefill_fn(params, padded, np.int32(true_length))

    batched_prefill = True  # `prefill_many` computes prompts together (the `Scheduler` asks)

    def prefill_many(self, params: Weights, prompts: Sequence[Sequence[int]], *,
                     max_rows: int = 16) -> list[Prefix]:
        """`prefill` of each prompt, computed together: the prompts of one bucket go through the
        model as the rows of one forward, whose matmuls use the machine far better than one row
        at a time. Only power-of-two row counts up to `max_rows` compile: a bucket's prompts
        are split into such calls, padded only where that wastes little
        (`jaxrl.rounding.power_of_two_parts`: 9 prompts run as 8 + 1 rows, 7 as 8). Rows are
        split over the mesh's `dp` devices when they divide evenly. Each prefix is the one
        `prefill` gives (up to the matmuls' rounding)."""
        if not isinstance(max_rows, int) or max_rows < 1:
            raise ValueError(f"prefill_many: max_rows must be an integer >= 1, got {max_rows!r}")
        by_bucket: dict[int, list[int]] = {}
        for i, prompt in enumerate(prompts):
            if len(prompt) == 0:
                raise ValueError(f"prefill_many: prompt {i} is empty")
            by_bucket.setdefault(self.bucket_for(len(prompt)), []).append(i)
        out: list[Prefix | None] = [None] * len(prompts)
        for bucket, members in by_bucket.items():
            start = 0
            for rows in power_of_two_parts(len(members), max_rows):
                part, start = members[start:start + rows], start + rows
                if rows == 1:
                    out[part[0]] = self.prefill(params, prompts[part[0]])
                    continue
                self.prefill_shapes.add((rows, bucket))
                tokens = np.zeros((rows, bucket), np.int32)
                lengths = np.ones((rows,), np.int32)  # padding rows: one token, results dropped
                for r, i in enumerate(part):
                    tokens[r, :len(prompts[i])] = np.asarray(prompts[i], np.int32)
                    lengths[r] = len(prompts[i])
                if self.mesh is not None:
                    rows_on = lambda x: jax.device_put(x, logical_sharding(
                        self.mesh, "generator", ("cache_batch",) + (None,) * (x.ndim - 1),
                        x.shape))
                    tokens, lengths = rows_on(tokens), rows_on(lengths)
                with self.mesh_context(params):
                    prefixes = self._prefill_rows_fn(params, tokens, lengths)
                for r, i in enumerate(part):
                    out[i] = prefixes[r]
        return out

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
               slot_params: SlotParams) -> DecodeState:
        """Put one sample of a prefilled prompt into `slot`, drawing its first token."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"insert: slot {slot} outside [0, {self.num_slots})")
        with self.mesh_context(decode_state):
            return self._insert_fn(prefix, decode_state, np.int32(slot), slot_params)

    def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """End `slot`'s sample now (finish reason stop): the host found a stop string in its
        text (`jaxrl.generate.stops`). The slot is free for the next `insert`."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"release: slot {slot} outside [0, {self.num_slots})")
        with self.mesh_context(decode_state):
            return self._release_fn(decode_state, np.int32(slot))

    def generate(self, params: Weights, decode_state: DecodeState
                 ) -> tuple[DecodeState, StepResult]:
        """Advance every active slot by one token."""
        with self.mesh_context(decode_state):
            return self._chunk_fns[1](params, decode_state, np.int32(self.num_slots + 1))

    def generate_chunk(self, params: Weights, decode_state: DecodeState,
                       min_finished: int | None = None) -> tuple[DecodeState, StepResult]:
        """Up to `chunk_steps` decode steps in one call.

        Stops early when no slot is active, or once `min_finished` slots have finished during
        this chunk (the scheduler sets it when requests wait for a free slot).
        """
        target = self.num_slots + 1 if min_finished is None else int(min_finished)
        if self.debug_delay_s:
            time.sleep(self.debug_delay_s)  # an artificially slow generator (tests, benchmarks)
        with self.mesh_context(decode_state):
            return self._chunk_fns[self.chunk_steps](params, decode_state, np.int32(target))

    def precompile(self, prefill_shapes: Sequence[tuple[int, int]] = ()) -> int:
        """Compile this engine's executables before their first call (`jit(...).lower(...)
        .compile()` on abstract arguments with its shardings; later calls reuse them): the empty
        decode state, both decode-chunk sizes, `release`, and `prefill` / `prefill_many` of each
        `(rows, bucket)` in `prefill_shapes` (another engine's `prefill_shapes`) with the
        `insert` of its prefixes. Needs a mesh; with its weights released, `set_params` first.
        Returns the number compiled."""
        if self.mesh is None or self.params is None:
            weights = "released" if self.params is None else "set"
            raise ValueError("precompile: needs an engine on a mesh holding its weights (mesh "
                             f"{self.mesh}, weights {weights})")
        sds = lambda x, sh=None: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh)
        i32 = jax.ShapeDtypeStruct((), np.int32)
        rows_on = lambda shape: jax.ShapeDtypeStruct(shape, np.int32, sharding=logical_sharding(
            self.mesh, "generator", ("cache_batch",) + (None,) * (len(shape) - 1), shape))
        state = jax.tree.map(sds, jax.eval_shape(self._empty_state), self._state_shardings)
        slot = self.slot_params(key_data=np.zeros(2, np.uint32), sample_index=0,
                                temperature=1.0, top_k=0, top_p=1.0, max_tokens=1,
                                stop_token_ids=())
        slot = jax.tree.map(lambda x: sds(np.asarray(x)), slot)
        if self._init_state_fn is None:
            self._init_state_fn = jax.jit(self._empty_state, out_shardings=self._state_shardings)
        with jax.set_mesh(self.mesh):
            lowered = [self._init_state_fn.lower(), self._release_fn.lower(state, i32)]
            lowered += [fn.lower(self.params, state, i32) for fn in self._chunk_fns.values()]
            for rows, bucket in sorted(set(prefill_shapes)):
                if rows == 1:
                    tokens = jax.ShapeDtypeStruct((1, bucket), np.int32)
                    lower = self._prefill_fn.lower(self.params, tokens, i32)
                else:
                    lower = self._prefill_rows_fn.lower(self.params, rows_on((rows, bucket)),
                                                        rows_on((rows,)))
                compiled = lower.compile()
                prefix = jax.tree.map(sds, lower.out_info, compiled.output_shardings)
                prefix = prefix if rows == 1 else prefix[0]
                lowered.append(self._insert_fn.lower(prefix, state, i32, slot))
            for lower in lowered:
                lower.compile()
        return len(lowered) + len(set(prefill_shapes))

    def mesh_context(self, *args):
        """The generator mesh in context (`jax.set_mesh`) while tracing / running, so Pallas
        attention runs per shard on it (`jaxrl.models.attention.kernel_shard_axes`). Nothing
        without a mesh, or when `args` are tracers: inside a caller's `jit` `set_mesh` is not
        allowed, and the caller's own context applies (wrap such a `jit` call in this)."""
        if self.mesh is None or any(isinstance(x, jax.core.Tracer) for x in jax.tree.leaves(args)):
            return contextlib.nullcontext()
        return jax.set_mesh(self.mesh)

    # ------------------------------------------------------------------ jitted bodies

    def _prefill_impl(self, params: Weights, tokens_1P, true_length):
        return self._prefill_rows_impl(params, tokens_1P, true_length[None])[0]

    def _prefill_rows_impl(self, params: Weights, tokens_NP, lengths_N) -> tuple[Prefix, ...]:
        """One prefix per row of `tokens_NP` (row r: its first `lengths_N[r]` tokens)."""
        model = nnx.merge(self.graphdef, params.state)
        n, p = tokens_NP.shape
        # the prefix's layout is the decode cache's (pages are filled from [B, S, K, D] rows)
        cache = KVCache.init(self.cfg, n, p,
                             heads_major=False if self.kv_layout == "paged" else None)
        rope = prompt_rope_tables(self.cfg, p) if self.wide_dots else None  # CPU: constants
        hidden_NPE, cache, experts_LNPK = model.decode_hidden_routed(tokens_NP, cache, lengths_N,
                                                                     rope)
        last_N1E = jnp.take_along_axis(hidden_NPE, (lengths_N - 1)[:, None, None], axis=1)
        logits_NV = model.logits(last_N1E)[:, 0]
        if experts_LNPK is not None:
            experts_LNPK = experts_LNPK.astype(experts_dtype(self.cfg.num_experts))
        row = lambda x, r: jax.lax.slice_in_dim(x, r, r + 1, axis=0)
        return tuple(
            Prefix(cache=KVCache(k=[row(k, r) for k in cache.k], v=[row(v, r) for v in cache.v],
                                 lengths_B=row(cache.lengths_B, r),
                                 heads_major=cache.heads_major),
                   logits_V=logits_NV[r], true_length=lengths_N[r], version=params.version,
                   experts_LPK=None if experts_LNPK is None else experts_LNPK[:, r])
            for r in range(n))

    def _insert_impl(self, prefix: Prefix, state: DecodeState, slot, sp: SlotParams):
        key = sample_key(sp.key_data, sp.sample_index, 0)
        logits_1V = ban_stop_ids(prefix.logits_V[None], sp.stop_ids[None], sp.min_tokens[None] > 0)
        token, logprob = sample_tokens(logits_1V, key[None], sp.temperature[None],
                                       sp.top_k[None], sp.top_p[None])
        token, logprob = token[0], logprob[0]
        stopped = jnp.any(token == sp.stop_ids)
        finish = jnp.where(stopped, FINISH_STOP,
                           jnp.where(sp.max_tokens <= 1, FINISH_LENGTH, FINISH_NONE))
        cache = state.cache.insert(slot, prefix.cache, prefix.true_length)
        base = jax.random.key_data(jax.random.fold_in(
            jax.random.wrap_key_data(sp.key_data, impl="threefry2x32"), sp.sample_index))
        return dataclasses.replace(
            state, cache=cache, tokens_B=state.tokens_B.at[slot].set(token),
            active_B=state.active_B.at[slot].set(finish == FINISH_NONE),
            num_generated_B=state.num_generated_B.at[slot].set(1),
            max_tokens_B=state.max_tokens_B.at[slot].set(sp.max_tokens),
            finish_reason_B=state.finish_reason_B.at[slot].set(finish),
            key_data_B2=state.key_data_B2.at[slot].set(base),
            temperature_B=state.temperature_B.at[slot].set(sp.temperature),
            top_k_B=state.top_k_B.at[slot].set(sp.top_k),
            top_p_B=state.top_p_B.at[slot].set(sp.top_p),
            stop_ids_BS=state.stop_ids_BS.at[slot].set(sp.stop_ids),
            min_tokens_B=state.min_tokens_B.at[slot].set(sp.min_tokens),
            pending_B=state.pending_B.at[slot].set(True),
            pending_logprob_B=state.pending_logprob_B.at[slot].set(logprob),
            pending_version_B=state.pending_version_B.at[slot].set(prefix.version))

    def _release_impl(self, state: DecodeState, slot):
        return dataclasses.replace(
            state, active_B=state.active_B.at[slot].set(False),
            pending_B=state.pending_B.at[slot].set(False),
            finish_reason_B=state.finish_reason_B.at[slot].set(FINISH_STOP))

    def _step(self, model: Transformer, st: DecodeState):
        """One decode step for all slots; inactive slots compute but change nothing."""
        act_B = st.active_B
        rope = (table_rope(self.cfg, st.cache.lengths_B[:, None], self.max_len)
                if self.wide_dots else None)  # CPU: rows of a loop-invariant table
        h_B1E, cache, experts_LB1K = model.decode_hidden_routed(
            st.tokens_B[:, None], st.cache, num_valid_B=act_B.astype(jnp.int32), rope=rope)
        # CPU, tied head: the logits [V, B] as made and read (lowp_dots.table_logits), no transpose
        vm = lowp_dots.active() and self.cfg.tie_embeddings
        logits = model.logits(h_B1E, vocab_major=vm)[:, :, 0] if vm else model.logits(h_B1E)[:, 0]
        keys_B = jax.vmap(lambda d, t: jax.random.fold_in(
            jax.random.wrap_key_data(d, impl="threefry2x32"), t))(st.key_data_B2,
                                                                  st.num_generated_B)
        logits = jax.lax.cond(  # min_tokens: no stop id before the sample's minimum length
            jnp.any(st.num_generated_B < st.min_tokens_B),
            lambda x: ban_stop_ids(x, st.stop_ids_BS, st.num_generated_B < st.min_tokens_B,
                                   vocab_major=vm),
            lambda x: x, logits)
        tok_B, logp_B = sample_tokens(logits, keys_B, st.temperature_B, st.top_k_B, st.top_p_B,
                                      vocab_major=vm)
        tok_B = jnp.where(act_B, tok_B, st.tokens_B)
        num_B = st.num_generated_B + act_B.astype(jnp.int32)
        stop_B = act_B & jnp.any(tok_B[:, None] == st.stop_ids_BS, axis=-1)
        length_B = act_B & ~stop_B & (num_B >= st.max_tokens_B)
        finish_B = jnp.where(stop_B, FINISH_STOP,
                             jnp.where(length_B, FINISH_LENGTH, st.finish_reason_B))
        st = dataclasses.replace(st, cache=cache, tokens_B=tok_B, num_generated_B=num_B,
                                 active_B=act_B & ~stop_B & ~length_B, finish_reason_B=finish_B)
        experts_BLK = None if experts_LB1K is None else jnp.swapaxes(experts_LB1K[:, :, 0], 0, 1)
        return st, tok_B, logp_B, act_B, experts_BLK

    def _chunk_impl(self, params: Weights, state: DecodeState, min_finished, *, num_steps: int):
        model = nnx.merge(self.graphdef, params.state)
        rows, b = num_steps + 1, self.num_slots
        tokens = jnp.zeros((rows, b), jnp.int32).at[0].set(state.tokens_B)
        logprobs = jnp.zeros((rows, b), jnp.float32).at[0].set(state.pending_logprob_B)
        versions = jnp.full((rows, b), params.version, jnp.int32).at[0].set(
            state.pending_version_B)
        valid = jnp.zeros((rows, b), bool).at[0].set(state.pending_B)
        experts = None
        if self.cfg.num_experts:  # a mixture of experts records its routing
            shape = (rows, b, num_sparse_layers(self.cfg), self.cfg.experts_per_token)
            experts = jnp.full(shape, -1, experts_dtype(self.cfg.num_experts))
        state = dataclasses.replace(state, pending_B=jnp.zeros_like(state.pending_B))
        started_B = state.active_B

        def cond(carry):
            i, st, _ = carry
            finished = jnp.sum(started_B & ~st.active_B)
            return (i < num_steps) & jnp.any(st.active_B) & (finished < min_finished)

        def body(carry):
            i, st, (tokens, logprobs, valid, experts) = carry
            st, tok_B, logp_B, emitted_B, experts_BLK = self._step(model, st)
            tokens = jax.lax.dynamic_update_index_in_dim(tokens, tok_B, i + 1, 0)
            logprobs = jax.lax.dynamic_update_index_in_dim(logprobs, logp_B, i + 1, 0)
            valid = jax.lax.dynamic_update_index_in_dim(valid, emitted_B, i + 1, 0)
            if experts is not None:
                experts = jax.lax.dynamic_update_index_in_dim(
                    experts, experts_BLK.astype(experts.dtype), i + 1, 0)
            return i + 1, st, (tokens, logprobs, valid, experts)

        steps, state, (tokens, logprobs, valid, experts) = jax.lax.while_loop(
            cond, body, (jnp.int32(0), state, (tokens, logprobs, valid, experts)))
        result = StepResult(tokens_CB=tokens, logprobs_CB=logprobs, versions_CB=versions,
                            valid_CB=valid, active_B=state.active_B,
                            finish_reason_B=state.finish_reason_B, num_steps=steps,
                            experts_CBLK=experts)
        return state, result
