"""JetStream `Engine` over jaxrl's `JaxEngine`, so JetStream's orchestrator can serve a policy.

    from jaxrl.serving.jetstream_adapter import make_driver, make_jetstream_engines
    prefill, generate = make_jetstream_engines(model, num_slots=8, max_len=1024,
                                               tokenizer=tok, generate_mesh=mesh)
    driver = make_driver(prefill, generate)   # jetstream.core.orchestrator.Driver
    ...                                       # LLMOrchestrator(driver).Decode(request)
    driver.stop()

Imports `jetstream` (google-jetstream 0.2.2, the `jetstream` extra; it pulls TensorFlow through
seqio). Core jaxrl never imports this module.

How jaxrl's engine maps onto JetStream 0.2.2:

- `prefill(params=, padded_tokens=, true_length=)` takes JetStream's padded prompt, drops the
  padding and prefills with `JaxEngine.prefill` (which pads to its own buckets). JetStream
  prepends the tokenizer's BOS to every fresh request; for a tokenizer without BOS (Qwen) the
  adapter reports a placeholder BOS id (-1) and drops it again here.
- `insert(prefix, decode_state, slot)` writes the prefix into a slot with the engine-wide sampling
  settings (JetStream 0.2.2 requests carry none) and a token budget that fills the KV cache;
  JetStream itself stops a request at its `max_tokens`.
- `generate(params, decode_state)` returns one token per slot in `ResultTokens` layout
  `[slots, 3] = (token, valid, length)`, with `samples_per_slot=1`. jaxrl's `insert` already
  draws a sample's first token; a slot inserted since the last step reports that token and sits
  out the decode step, so every call yields exactly one token per live slot and `length` counts
  the tokens generated so far (JetStream ends a request when `length > max_tokens`).
  A finished slot (EOS / stop id / full cache) reports `valid=0`, which JetStream reads as
  complete; the stop token itself is reported, and JetStream drops it from the stream (jaxrl
  completions keep it).
- Requests the engine cannot serve exactly (token ids outside the vocabulary, an empty prompt)
  are logged and answered with an empty stream: an exception in an engine call would make
  JetStream kill the whole server process.
- Prefill and generate engines may run on different meshes; the prefix moves to the generate
  mesh replicated (`get_prefix_destination_sharding`), and `insert` lays it out on the slots.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec, SingleDeviceSharding
from jetstream.engine import engine_api, token_utils, tokenizer_api, tokenizer_pb2

from jaxrl.generate.engine import DecodeState, JaxEngine, Prefix, Weights
from jaxrl.generate.sampling import SamplingParams, seed_key_data
from jaxrl.models.hf import load_pretrained
from jaxrl.models.transformer import Transformer

log = logging.getLogger(__name__)

NO_BOS = -1  # BOS id reported to JetStream for tokenizers without one; prefill drops it
JETSTREAM_PREFILL_LENGTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192, 16384, 32768)
GREEDY = SamplingParams(temperature=0.0)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class ServedPrefix:
    """What travels from the prefill engine to the generate engine.

    `prefix` is None when the request was rejected (`error` says why); `insert` then frees the
    slot so that JetStream closes the request with no tokens.
    """

    prefix: Prefix | None
    error: str | None = dataclasses.field(default=None, metadata=dict(static=True))


class JaxrlTokenizer(tokenizer_api.Tokenizer):
    """JetStream's tokenizer interface over a jaxrl tokenizer (or none: token-id requests only).

    `stop_tokens` are the engine's stop ids (JetStream's default would also stop on the pad id).
    """

    def __init__(self, tokenizer: Any | None, stop_ids: Sequence[int]):
        self.tokenizer = tokenizer
        self._stop = frozenset(int(t) for t in stop_ids)
        self._bos = getattr(tokenizer, "bos_id", None)
        if self._bos is None and getattr(tokenizer, "bos_token", None):  # HFTokenizer
            ids = tokenizer.encode(tokenizer.bos_token)
            self._bos = ids[0] if len(ids) == 1 else None

    def encode(self, s: str, **kwargs):
        if self.tokenizer is None:
            raise ValueError("this engine has no tokenizer: send token ids (token_content)")
        ids = np.asarray(self.tokenizer.encode(s), np.int32)
        return token_utils.pad_tokens(
            ids, self.bos_id, self.pad_id, is_bos=kwargs.get("is_bos", True),
            prefill_lengths=kwargs.get("prefill_lengths"),
            max_prefill_length=kwargs.get("max_prefill_length"),
            jax_padding=kwargs.get("jax_padding", True))

    def decode(self, token_ids: list[int], **kwargs) -> str:
        """Text of `token_ids`; "" for ids the tokenizer cannot decode (a model's vocabulary may
        be larger than its tokenizer's), since an exception here would kill the server."""
        if self.tokenizer is None:
            return ""
        try:
            return self.tokenizer.decode([int(t) for t in token_ids])
        except (ValueError, KeyError, IndexError, OverflowError):
            return ""

    @property
    def pad_id(self) -> int:
        return int(getattr(self.tokenizer, "pad_id", 0))

    @property
    def eos_id(self) -> int:
        eos = getattr(self.tokenizer, "eos_id", None)
        return int(eos) if eos is not None else min(self._stop, default=-1)

    @property
    def bos_id(self) -> int:
        return NO_BOS if self._bos is None else int(self._bos)

    @property
    def stop_tokens(self) -> set[int]:
        return set(self._stop)


class JetStreamEngine(engine_api.Engine):
    """`jetstream.engine.engine_api.Engine` delegating to a `JaxEngine`.

    Args:
      engine: the jaxrl engine (its mesh, slots, cache length and EOS ids are used as is).
      tokenizer: a jaxrl tokenizer (`CharTokenizer`, `HFTokenizer`) or None.
      sampling: engine-wide sampling (temperature, top_k, top_p, seed, stop_token_ids);
        `max_tokens` and `n` are ignored (JetStream requests carry `max_tokens`; one sample each).
      max_prefill_length: longest prompt JetStream sends (JetStream keeps the last tokens of a
        longer one); one of JetStream's buckets (16, 32, ..., 32768) and below `engine.max_len`.
      tokenizer_path: reported by `get_tokenizer()` (informational).
    """

    def __init__(self, engine: JaxEngine, *, tokenizer: Any | None = None,
                 sampling: SamplingParams = GREEDY, max_prefill_length: int | None = None,
                 tokenizer_path: str = ""):
        if sampling.n != 1:
            raise ValueError(f"JetStream serves one sample per request; got n={sampling.n}")
        self.engine = engine
        self.sampling = sampling
        self._max_prefill = _check_prefill_length(max_prefill_length, engine.max_len)
        self._stop_ids = tuple(sorted(set(engine.eos_ids) | set(sampling.stop_token_ids)))
        engine.check_token_ids(self._stop_ids, "stop ids")
        if len(self._stop_ids) > engine.max_stop_ids:
            raise ValueError(f"{len(self._stop_ids)} stop ids (EOS included) exceed the engine's "
                             f"max_stop_ids ({engine.max_stop_ids})")
        self._tokenizer = JaxrlTokenizer(tokenizer, self._stop_ids)
        self._tokenizer_path = str(tokenizer_path)
        self._strip_bos = self._tokenizer.bos_id == NO_BOS
        self._key_data = seed_key_data(sampling.seed)
        self._request_ids = itertools.count()
        self._mesh = engine.mesh or Mesh(np.array(jax.devices()[:1], dtype=object).reshape(1, 1),
                                         ("dp", "tp"))
        self._generate_fn = jax.jit(self._generate_impl, donate_argnums=(1,))
        self._release_fn = jax.jit(_release_slot, donate_argnums=(0,))

    # ------------------------------------------------------------------ params and state

    def load_params(self, *args, **kwargs) -> Weights:
        """The engine's current weights (already on its mesh)."""
        return self.engine.params

    def init_decode_state(self, *args, **kwargs) -> DecodeState:
        return self.engine.init_decode_state()

    # ------------------------------------------------------------------ prefill / insert

    def prefill(self, *, params: Weights, existing_prefix: Any = None, padded_tokens,
                true_length: int) -> ServedPrefix:
        if existing_prefix is not None:
            raise NotImplementedError("jaxrl's engine prefills whole prompts (no existing_prefix)")
        tokens = np.asarray(padded_tokens).reshape(-1)
        n = min(int(true_length), tokens.shape[0])  # JetStream truncates long prompts
        if int(true_length) > tokens.shape[0]:
            log.warning("prompt of %d tokens truncated to its last %d", true_length, n)
        tokens = tokens[:n]
        if self._strip_bos and n and tokens[0] == NO_BOS:
            tokens = tokens[1:]
        error = None
        if tokens.size == 0:
            error = "empty prompt"
        elif tokens.min() < 0 or tokens.max() >= self.engine.cfg.vocab_size:
            bad = tokens[(tokens < 0) | (tokens >= self.engine.cfg.vocab_size)]
            error = (f"token ids {sorted(set(bad.tolist()))[:8]} outside the vocabulary "
                     f"[0, {self.engine.cfg.vocab_size})")
        if error is not None:
            log.error("jaxrl JetStream engine: request rejected (%s); it gets no tokens", error)
            return ServedPrefix(None, error)
        return ServedPrefix(self.engine.prefill(params, tokens.tolist(), tokens.size))

    def insert(self, prefix: ServedPrefix, decode_state: DecodeState, slot: int
               ) -> DecodeState:
        if prefix.prefix is None:
            with self.engine.mesh_context(decode_state):
                return self._release_fn(decode_state, np.int32(slot))
        true_length = int(prefix.prefix.true_length)
        s = self.sampling
        params = self.engine.slot_params(
            key_data=self._key_data, sample_index=next(self._request_ids),
            temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
            max_tokens=self.engine.max_len - true_length, stop_token_ids=self._stop_ids)
        return self.engine.insert(prefix.prefix, decode_state, int(slot), params)

    # ------------------------------------------------------------------ generate

    def generate(self, params: Weights, decode_state: DecodeState
                 ) -> tuple[DecodeState, engine_api.ResultTokens]:
        with self.engine.mesh_context(decode_state):  # Pallas per shard inside our jit too
            decode_state, data = self._generate_fn(params, decode_state)
        result = engine_api.ResultTokens(data=data, tokens_idx=(0, 1), valid_idx=(1, 2),
                                         length_idx=(2, 3), samples_per_slot=1)
        return decode_state, result

    def _generate_impl(self, params: Weights, state: DecodeState):
        """One token per slot: newly inserted slots report their first token and skip the step."""
        hold_B = state.pending_B & state.active_B
        state = dataclasses.replace(state, active_B=state.active_B & ~hold_B)
        state, r = self.engine.generate(params, state)
        state = dataclasses.replace(state, active_B=state.active_B | hold_B)
        first_B = r.valid_CB[0]
        tokens_B = jnp.where(first_B, r.tokens_CB[0], r.tokens_CB[1])
        valid_B = first_B | r.valid_CB[1]
        data = jnp.stack([tokens_B, valid_B.astype(jnp.int32), state.num_generated_B], axis=1)
        return state, data.astype(jnp.int32)

    # ------------------------------------------------------------------ JetStream plumbing

    def get_prefix_destination_sharding(self) -> Any:
        if self.engine.mesh is None:
            return SingleDeviceSharding(jax.devices()[0])
        return NamedSharding(self.engine.mesh, PartitionSpec())

    def get_tokenizer(self) -> tokenizer_pb2.TokenizerParameters:
        return tokenizer_pb2.TokenizerParameters(path=self._tokenizer_path or "jaxrl")

    def build_tokenizer(self, metadata: tokenizer_pb2.TokenizerParameters) -> JaxrlTokenizer:
        return self._tokenizer

    @property
    def max_concurrent_decodes(self) -> int:
        return self.engine.num_slots

    @property
    def samples_per_slot(self) -> int:
        return 1

    @property
    def max_prefill_length(self) -> int:
        return self._max_prefill

    @property
    def mesh(self) -> Mesh:
        return self._mesh

    @property
    def colocated_cpus(self) -> None:
        return None


def _release_slot(state: DecodeState, slot) -> DecodeState:
    """Stop whatever runs in `slot` (JetStream reads the next step's `valid=0` as complete)."""
    return dataclasses.replace(state, active_B=state.active_B.at[slot].set(False),
                               pending_B=state.pending_B.at[slot].set(False))


def _check_prefill_length(max_prefill_length: int | None, max_len: int) -> int:
    """JetStream pads prompts to its own buckets, cut at `max_prefill_length`, which must be one
    of them; it must leave room in the KV cache for at least one generated token."""
    fits = [b for b in JETSTREAM_PREFILL_LENGTHS if b < max_len]
    if max_prefill_length is None:
        half = [b for b in fits if b <= max_len // 2]
        if not (half or fits):
            raise ValueError(f"max_len={max_len} is too small to serve with JetStream "
                             f"(its smallest prefill bucket is {JETSTREAM_PREFILL_LENGTHS[0]})")
        return (half or fits)[-1]
    if max_prefill_length not in fits:
        raise ValueError(f"max_prefill_length={max_prefill_length} must be one of JetStream's "
                         f"prefill buckets below max_len={max_len}: {fits}")
    return int(max_prefill_length)


def _as_model(model_or_path, mesh: Mesh | None, dtype: str | None) -> Transformer:
    if isinstance(model_or_path, Transformer):
        return model_or_path
    if isinstance(model_or_path, tuple) and isinstance(model_or_path[-1], Transformer):
        return model_or_path[-1]
    return load_pretrained(model_or_path, dtype, mesh=mesh, role="generator")[1]


def make_jetstream_engines(
    model_or_path, *, num_slots: int, max_len: int, tokenizer: Any | None = None,
    prefill_mesh: Mesh | None = None, generate_mesh: Mesh | None = None,
    sampling: SamplingParams = GREEDY, eos_ids: Sequence[int] | None = None,
    max_prefill_length: int | None = None, dtype: str | None = None,
    tokenizer_path: str = "",
) -> tuple[JetStreamEngine, JetStreamEngine]:
    """A prefill engine and a generate engine for JetStream's `Driver`.

    `model_or_path` is a `Transformer`, a `(config, Transformer)` pair or a local HF checkpoint
    directory. With `prefill_mesh is generate_mesh` (both None by default) the two are one
    engine (JetStream's interleaved mode); otherwise each gets its own copy of the weights on
    its own mesh (generator role: slots over `dp`, heads over `tp`). `eos_ids` default to the
    tokenizer's EOS. The prefill engine's decode state is never used.
    """
    if (prefill_mesh is None) != (generate_mesh is None):
        raise ValueError("make_jetstream_engines: give both prefill_mesh and generate_mesh, or "
                         "neither (one engine on the default device)")
    model = _as_model(model_or_path, generate_mesh, dtype)
    if eos_ids is None:
        eos = getattr(tokenizer, "eos_id", None)
        eos_ids = () if eos is None else (int(eos),)
    kw = dict(tokenizer=tokenizer, sampling=sampling, max_prefill_length=max_prefill_length,
              tokenizer_path=tokenizer_path)
    generate = JetStreamEngine(
        JaxEngine(model, num_slots=num_slots, max_len=max_len, mesh=generate_mesh,
                  eos_ids=eos_ids, chunk_steps=1), **kw)
    if prefill_mesh is generate_mesh:
        return generate, generate
    prefill = JetStreamEngine(
        JaxEngine(model, num_slots=1, max_len=max_len, mesh=prefill_mesh, eos_ids=eos_ids,
                  chunk_steps=1), **kw)
    return prefill, generate


def make_driver(prefill: JetStreamEngine | Sequence[JetStreamEngine],
                generate: JetStreamEngine | Sequence[JetStreamEngine], **driver_kwargs):
    """JetStream's in-process `Driver` over these engines (call `.stop()` when done).

    Interleaved mode (no prefix transfer) when the prefill and generate engines are the same
    objects. Also makes JetStream 0.2.2 work with jax >= 0.6 (see `patch_jetstream`).
    """
    from jetstream.core import orchestrator

    patch_jetstream()
    prefill = [prefill] if isinstance(prefill, JetStreamEngine) else list(prefill)
    generate = [generate] if isinstance(generate, JetStreamEngine) else list(generate)
    driver_kwargs.setdefault("interleaved_mode", prefill == generate)
    return orchestrator.Driver(
        prefill_engines=prefill, generate_engines=generate,
        prefill_params=[e.load_params() for e in prefill],
        generate_params=[e.load_params() for e in generate], **driver_kwargs)


def patch_jetstream() -> None:
    """JetStream 0.2.2's orchestrator frees prefixes with `jax.tree_map`, removed in jax 0.6.

    Its generate thread would die on the first insert (and JetStream then SIGKILLs the process),
    so replace that one helper with the same code on `jax.tree.leaves`. Idempotent.
    """
    from jetstream.core import orchestrator

    if hasattr(jax, "tree_map") or getattr(orchestrator.delete_pytree, "_jaxrl", False):
        return

    def delete_pytree(p):
        for leaf in jax.tree.leaves(p):
            if isinstance(leaf, jax.Array):
                leaf.delete()

    delete_pytree._jaxrl = True
    orchestrator.delete_pytree = delete_pytree
