"""What the generation engine passes around: weights with their version, a prefilled prompt, a
slot's sampling settings, the decode state of all slots, one chunk's results, and the `Engine`
interface (the shape of JetStream's) that `jaxrl.generate.engine.JaxEngine` implements."""

from __future__ import annotations

import dataclasses
import typing
from collections.abc import Sequence
from typing import Any, Protocol

import jax

from jaxrl.config import KVLayout
from jaxrl.models.paged import PagedKVCache
from jaxrl.models.transformer import KVCache

FINISH_NONE, FINISH_STOP, FINISH_LENGTH = 0, 1, 2
FINISH_REASONS = {FINISH_STOP: "stop", FINISH_LENGTH: "length"}
KV_LAYOUTS = typing.get_args(KVLayout)


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Weights:
    """Model parameters plus the policy version that produced them (an int32 scalar)."""

    state: Any  # nnx.State
    version: jax.Array


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class Prefix:
    """One prefilled prompt: its KV cache row, the logits after its last token, its length."""

    cache: KVCache  # one row, bucketed length
    logits_V: jax.Array  # f32, at position true_length - 1
    true_length: jax.Array  # int32
    version: jax.Array  # int32: the weights that computed this prefix
    experts_LPK: jax.Array | None = None  # a mixture of experts: each prompt token's experts


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class SlotParams:
    """Per-sample settings written into a slot by `insert` (built by `Engine.slot_params`)."""

    key_data: jax.Array  # uint32 [2]: the request seed's key
    sample_index: jax.Array  # int32
    temperature: jax.Array  # f32
    top_k: jax.Array  # int32
    top_p: jax.Array  # f32
    max_tokens: jax.Array  # int32
    stop_ids: jax.Array  # int32 [max_stop_ids], -1 padded
    min_tokens: jax.Array  # int32: the stop ids are banned before this many tokens


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class DecodeState:
    """Everything about the slots that lives on device. `B` = num_slots."""

    cache: KVCache | PagedKVCache
    tokens_B: jax.Array  # int32: last emitted token (next decode input)
    active_B: jax.Array  # bool: still generating
    num_generated_B: jax.Array  # int32
    max_tokens_B: jax.Array  # int32
    finish_reason_B: jax.Array  # int32: FINISH_*
    key_data_B2: jax.Array  # uint32: fold_in(key(seed), sample_index) data
    temperature_B: jax.Array  # f32
    top_k_B: jax.Array  # int32
    top_p_B: jax.Array  # f32
    stop_ids_BS: jax.Array  # int32, -1 padded
    min_tokens_B: jax.Array  # int32
    pending_B: jax.Array  # bool: first token inserted but not yet reported
    pending_logprob_B: jax.Array  # f32
    pending_version_B: jax.Array  # int32


@jax.tree_util.register_dataclass
@dataclasses.dataclass
class StepResult:
    """What one chunk emitted. Row 0 reports first tokens drawn by `insert`; row i > 0 is step i.

    `valid_CB[i, b]` says whether slot b emitted `tokens_CB[i, b]` in row i.
    """

    tokens_CB: jax.Array
    logprobs_CB: jax.Array
    versions_CB: jax.Array
    valid_CB: jax.Array
    active_B: jax.Array
    finish_reason_B: jax.Array
    num_steps: jax.Array  # decode steps actually run (<= chunk_steps)
    # a mixture of experts: row i > 0 holds, per slot, the experts [Ls, K] its sparse layers
    # chose for the token fed at step i (the one the slot emitted in the row before); row 0 none
    experts_CBLK: jax.Array | None = None


class Engine(Protocol):
    """jaxrl's generation engine interface (the shape of JetStream's `Engine`)."""

    num_slots: int
    max_len: int

    def init_decode_state(self) -> DecodeState: ...

    def prefill(self, params: Weights, tokens: Sequence[int], true_length: int) -> Prefix: ...

    def insert(self, prefix: Prefix, decode_state: DecodeState, slot: int,
               slot_params: SlotParams) -> DecodeState: ...

    def release(self, decode_state: DecodeState, slot: int) -> DecodeState:
        """End `slot`'s sample now (finish reason stop): the host found a stop string in its
        text (`jaxrl.generate.stops`). The slot is free for the next `insert`."""
        ...

    def generate(self, params: Weights, decode_state: DecodeState
                 ) -> tuple[DecodeState, StepResult]: ...

    def generate_chunk(self, params: Weights, decode_state: DecodeState,
                       min_finished: int | None = None) -> tuple[DecodeState, StepResult]: ...

    def set_params(self, params: Any, version: int) -> None: ...
