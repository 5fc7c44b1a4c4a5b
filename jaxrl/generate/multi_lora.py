"""Decoding with different LoRA adapters of one base in one batch.

`MultiLoraEngine` is a `JaxEngine` whose weights are the shared base plus `max_adapters` adapters
of one layout (rank, targets) stacked on a leading axis (`A: [N, in..., r]`, `B: [N, r,
out...]`), and whose decode state holds each slot's adapter index (`adapter_B`). A prompt is
prefilled with the adapter its request names (`prefill(..., adapter=i)`); `insert` copies the
prefix's adapter index into the slot beside the slot's sampling parameters.

Each row runs its own adapter, `y[b] = x[b] W + s (x[b] A[idx[b]]) B[idx[b]]` (the segmented
multi-LoRA product): before a decode chunk (and a prefill) the rows' adapters are gathered once,
`A[adapter_B]` (`[slots, in..., r]`; the slots' indices change only between chunks), and
`jaxrl.models.lora.delta` computes the per-row product as two batched matmuls; the base matmuls
stay one matmul over all rows. The price of the gather: one adapter copy per slot while a chunk
runs (small next to the KV cache at LoRA ranks). A sample's tokens and log-probabilities are
those of a `JaxEngine` holding its adapter alone (to f32 rounding: XLA may order the sums
differently), since sampling keys depend only on the request's seed and sample index.

`Scheduler.submit(prompt, sampling, adapter=i)` routes a request to adapter `i`.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.sharding import NamedSharding, PartitionSpec

from jaxrl.generate.engine import DecodeState, JaxEngine, Prefix, Weights
from jaxrl.models import lora
from jaxrl.models.transformer import Transformer


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MultiLoraPrefix(Prefix):
    """A `Prefix` and the adapter that computed it (an int32 scalar)."""

    adapter: jax.Array | None = None


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class MultiLoraDecodeState(DecodeState):
    """A `DecodeState` with each slot's adapter index."""

    adapter_B: jax.Array | None = None  # int32 [slots]


def _is_adapter_leaf(path) -> bool:
    return any(lora.is_adapter(getattr(p, "key", None)) for p in path)


def gather_rows(state, adapter_B):
    """`state` with each stacked adapter leaf `[N, ...]` replaced by the rows' own, `[B, ...]`."""
    return jax.tree_util.tree_map_with_path(
        lambda path, x: x[adapter_B] if _is_adapter_leaf(path) else x, state)


@jax.jit
def _stack(adapters: tuple) -> dict:
    return jax.tree.map(lambda *xs: jnp.stack(xs), *adapters)


class MultiLoraEngine(JaxEngine):
    """A `JaxEngine` over a LoRA `model` serving up to `max_adapters` adapters of its layout at
    once. It starts with `model`'s own adapter in every position; `set_adapters(base, [a0, a1,
    ...])` installs others (pure dicts, as `lora.split` gives them) without recompiling. Other
    arguments: those of `JaxEngine`."""

    batched_prefill = False  # each prompt's prefill has its own adapter

    def __init__(self, model: Transformer, *, max_adapters: int, **kw):
        if not model.cfg.lora.enabled:
            raise ValueError("MultiLoraEngine: the model has no LoRA adapters (lora.rank 0); "
                             "use JaxEngine")
        if not isinstance(max_adapters, int) or max_adapters < 1:
            raise ValueError(f"MultiLoraEngine: max_adapters must be an integer >= 1, got "
                             f"{max_adapters!r}")
        self.max_adapters = max_adapters
        super().__init__(model, **kw)
        stacked = jax.tree_util.tree_map_with_path(
            lambda path, x: jnp.stack([x] * max_adapters) if _is_adapter_leaf(path) else x,
            self.params.state)
        if self._param_shardings is not None:  # the adapter axis is replicated
            self._param_shardings = jax.tree_util.tree_map_with_path(
                lambda path, s: NamedSharding(s.mesh, PartitionSpec(None, *s.spec))
                if _is_adapter_leaf(path) else s, self._param_shardings)
            stacked = jax.device_put(stacked, self._param_shardings)
        self.params = Weights(state=stacked, version=self.params.version)

    def set_adapters(self, base: dict, adapters: Sequence[dict], version: int = 0) -> None:
        """Serve `adapters[i]` as adapter `i` (the rest of the `max_adapters` positions repeat
        `adapters[0]`); `base`: the base parameters (pure dict)."""
        if not 1 <= len(adapters) <= self.max_adapters:
            raise ValueError(f"set_adapters: {len(adapters)} adapters; this engine holds 1 to "
                             f"{self.max_adapters}")
        padded = tuple(adapters) + (adapters[0],) * (self.max_adapters - len(adapters))
        model = nnx.merge(self.graphdef, lora.join(base, _stack(padded)))
        self.set_params(model, version)

    def check_adapter(self, adapter: int) -> None:
        if not isinstance(adapter, int | np.integer) or not 0 <= adapter < self.max_adapters:
            raise ValueError(f"adapter index {adapter!r} outside [0, {self.max_adapters}) of "
                             "this engine")

    def check_request(self, prompt: Sequence[int], max_tokens: int,
                      stop_token_ids: Sequence[int] = (), adapter: int = 0) -> None:
        self.check_adapter(adapter)
        super().check_request(prompt, max_tokens, stop_token_ids)

    # ------------------------------------------------------------------ Engine interface

    def prefill(self, params: Weights, tokens: Sequence[int], true_length: int | None = None,
                adapter: int = 0) -> MultiLoraPrefix:
        """`JaxEngine.prefill` with adapter `adapter`; the prefix remembers it for `insert`."""
        self.check_adapter(adapter)
        true_length = len(tokens) if true_length is None else int(true_length)
        if true_length < 1 or true_length > len(tokens):
            raise ValueError(f"prefill: true_length {true_length} must be in [1, {len(tokens)}]")
        padded = np.zeros((1, self.bucket_for(true_length)), np.int32)
        padded[0, :true_length] = np.asarray(tokens[:true_length], np.int32)
        with self.mesh_context(params):
            return self._prefill_fn(params, padded, np.int32(true_length), np.int32(adapter))

    # ------------------------------------------------------------------ jitted bodies

    def _empty_state(self) -> MultiLoraDecodeState:
        st = super()._empty_state()
        return MultiLoraDecodeState(**{f.name: getattr(st, f.name)
                                       for f in dataclasses.fields(st)},
                                    adapter_B=jnp.zeros((self.num_slots,), jnp.int32))

    def _prefill_impl(self, params: Weights, tokens_1P, true_length, adapter=None):
        rows = Weights(gather_rows(params.state, adapter[None]), params.version)
        prefix = super()._prefill_impl(rows, tokens_1P, true_length)
        return MultiLoraPrefix(**{f.name: getattr(prefix, f.name)
                                  for f in dataclasses.fields(prefix)}, adapter=adapter)

    def _insert_impl(self, prefix: MultiLoraPrefix, state: MultiLoraDecodeState, slot, sp):
        state = super()._insert_impl(prefix, state, slot, sp)
        return dataclasses.replace(state, adapter_B=state.adapter_B.at[slot].set(prefix.adapter))

    def _chunk_impl(self, params: Weights, state: MultiLoraDecodeState, min_finished, *,
                    num_steps: int):
        rows = Weights(gather_rows(params.state, state.adapter_B), params.version)
        return super()._chunk_impl(rows, state, min_finished, num_steps=num_steps)
