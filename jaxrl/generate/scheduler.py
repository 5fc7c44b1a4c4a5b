"""Continuous batching over a `JaxEngine`: a request queue, slot refills between decode chunks.

Each submitted request is a group of `n` samples of one prompt. The prompt is prefilled once when
its first sample gets a slot; every sample is inserted from that prefix (with its own key). After
each chunk the host reads the chunk's outputs once, appends them to the running samples, releases
slots whose sample finished (EOS / stop id / max_tokens) and refills them from the queue.

While requests wait, a chunk ends as soon as `refill_threshold` slots have finished, so a long
sample does not hold the other slots idle until the chunk's end.
"""

from __future__ import annotations

import collections
import dataclasses
import itertools
import time
from collections.abc import Sequence

import jax
import numpy as np

from jaxrl.generate.engine import FINISH_REASONS, JaxEngine, Prefix
from jaxrl.generate.sampling import SamplingParams, seed_key_data
from jaxrl.generate.stops import StopText


@dataclasses.dataclass
class Completion:
    """One finished sample. `logprobs[i]` is the behaviour log-probability of `tokens[i]` and
    `versions[i]` the policy version of the weights that sampled it."""

    request_id: int
    sample_index: int
    prompt: list[int]
    tokens: list[int]
    logprobs: list[float]
    versions: list[int]
    finish_reason: str  # "stop" (EOS or a stop id, kept as the last token) | "length"
    # a mixture of experts: the experts [Ls, prompt + tokens, K] each sparse layer chose for
    # each token (-1 where none was computed: the last token is sampled, never fed); else None
    routing: np.ndarray | None = None

    @property
    def prompt_tokens(self) -> int:
        return len(self.prompt)

    @property
    def num_tokens(self) -> int:
        return len(self.tokens)


@dataclasses.dataclass
class GenerateStats:
    """Counters since the scheduler was created (or `reset_stats`)."""

    chunks: int = 0
    decode_steps: int = 0
    active_slot_steps: int = 0  # slot-steps that emitted a token
    slot_steps: int = 0  # decode steps x slots
    generated_tokens: int = 0
    prompt_tokens: int = 0
    prefills: int = 0
    completions: int = 0
    busy_s: float = 0.0  # wall time inside step()
    # a `DisaggregatedEngine`: prefixes moved from the prefill to the decode devices
    kv_transfers: int = 0
    kv_transfer_s: float = 0.0
    kv_transfer_bytes: int = 0

    @property
    def slot_utilisation(self) -> float:
        return self.active_slot_steps / self.slot_steps if self.slot_steps else 0.0

    @property
    def tokens_per_s(self) -> float:
        return self.generated_tokens / self.busy_s if self.busy_s else 0.0

    def metrics(self) -> dict[str, float]:
        out = {"gen/tokens_per_s": self.tokens_per_s,
               "gen/slot_utilisation": self.slot_utilisation,
               "gen/generated_tokens": float(self.generated_tokens),
               "gen/prefills": float(self.prefills)}
        if self.kv_transfers:  # per prefill: seconds and bytes of its prefix's move
            out["gen/kv_transfer_s"] = self.kv_transfer_s / self.kv_transfers
            out["gen/kv_transfer_bytes"] = self.kv_transfer_bytes / self.kv_transfers
        return out


@dataclasses.dataclass
class _Group:
    request_id: int
    prompt: list[int]
    sampling: SamplingParams
    key_data: np.ndarray
    stop_text: StopText | None = None
    prefix: Prefix | None = None
    next_sample: int = 0
    prompt_experts: object = None  # the prefix's experts_LPK (device), read when a sample ends
    adapter: int | None = None  # a `MultiLoraEngine`'s adapter index for this request


@dataclasses.dataclass
class _Running:
    group: _Group
    sample_index: int
    tokens: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    experts: list[np.ndarray] = dataclasses.field(default_factory=list)  # [Ls, K] per fed token

    def routing(self) -> np.ndarray | None:
        """The sample's routing record, prompt then completion (see `Completion.routing`)."""
        prompt = self.group.prompt_experts
        if prompt is None:
            return None
        prompt_LPK = np.asarray(prompt)[:, : len(self.group.prompt)]
        out = np.full((prompt_LPK.shape[0], len(self.tokens), prompt_LPK.shape[2]), -1,
                      prompt_LPK.dtype)
        fed = self.experts[: len(self.tokens)]
        if fed:
            out[:, : len(fed)] = np.stack(fed, axis=1)
        return np.concatenate([prompt_LPK, out], axis=1)


class Scheduler:
    """Continuous batching: `submit` requests, call `step()` (one chunk) or `run()` (until idle).

    `set_params(params, version)` swaps weights between chunks; tokens sampled afterwards carry the
    new version (in-flight updates), samples already running keep their cache.
    """

    def __init__(self, engine: JaxEngine, *, refill_threshold: int = 1):
        if refill_threshold < 1:
            raise ValueError(f"refill_threshold must be >= 1, got {refill_threshold!r}")
        self.engine = engine
        self.refill_threshold = refill_threshold
        self.state = engine.init_decode_state()
        self.stats = GenerateStats()
        self._queue: collections.deque[_Group] = collections.deque()
        self._slots: list[_Running | None] = [None] * engine.num_slots
        self._ids = itertools.count()

    # ------------------------------------------------------------------ queue

    def submit(self, prompt: Sequence[int], sampling: SamplingParams,
               request_id: int | None = None, *, stop_text: StopText | None = None,
               adapter: int | None = None) -> int:
        """Queue `sampling.n` samples of `prompt`; returns the request id. Rejects (ValueError)
        a request the engine cannot serve exactly: empty prompt, unknown token or stop ids,
        prompt + max_tokens beyond the KV cache. `stop_text`: stop strings of several tokens,
        checked on the decoded tail after each chunk (`jaxrl.generate.stops`). `adapter`: the
        LoRA adapter to decode with, on a `jaxrl.generate.multi_lora.MultiLoraEngine`."""
        if not isinstance(sampling, SamplingParams):
            raise TypeError(f"sampling must be a SamplingParams, got {type(sampling).__name__}")
        prompt = [int(t) for t in prompt]
        kw = {} if adapter is None else {"adapter": adapter}
        self.engine.check_request(prompt, sampling.max_tokens, sampling.stop_token_ids, **kw)
        rid = next(self._ids) if request_id is None else int(request_id)
        self._queue.append(_Group(rid, prompt, sampling, seed_key_data(sampling.seed),
                                  stop_text, adapter=adapter))
        return rid

    @property
    def num_waiting(self) -> int:
        """Samples not yet in a slot."""
        return sum(g.sampling.n - g.next_sample for g in self._queue)

    @property
    def num_running(self) -> int:
        return sum(s is not None for s in self._slots)

    def has_work(self) -> bool:
        return bool(self._queue) or self.num_running > 0

    def set_params(self, params, version: int) -> None:
        self.engine.set_params(params, version)

    def release(self) -> None:
        """Free the decode state (the KV cache) and the engine's weights while there is no work:
        both come back on demand (the state empty, the weights from the next `set_params`)."""
        if self.has_work():
            raise RuntimeError(f"Scheduler.release: {self.num_running} samples running and "
                               f"{self.num_waiting} waiting; release only when idle")
        self.state = None
        self.engine.release_params()

    def reset_stats(self) -> None:
        self.stats = GenerateStats()

    # ------------------------------------------------------------------ chunks

    def refill(self) -> None:
        """Prefill and insert queued samples into free slots (`step` does this first)."""
        engine = self.engine
        if engine.params is None:
            raise RuntimeError("Scheduler: the engine's weights were released; set_params first")
        if self.state is None:
            self.state = engine.init_decode_state()
        if getattr(engine, "batched_prefill", False):
            self._prefill_ahead()
        for slot in range(engine.num_slots):
            if self._slots[slot] is not None:
                continue
            if not self._queue:
                return
            group = self._queue[0]
            if group.prefix is None:
                kw = {} if group.adapter is None else {"adapter": group.adapter}
                self._prefilled(group, engine.prefill(engine.params, group.prompt, **kw))
                moved = getattr(engine, "last_kv_transfer", None)  # (seconds, bytes)
                if moved is not None:
                    self.stats.kv_transfers += 1
                    self.stats.kv_transfer_s += moved[0]
                    self.stats.kv_transfer_bytes += moved[1]
            sp = group.sampling
            params = engine.slot_params(
                key_data=group.key_data, sample_index=group.next_sample,
                temperature=sp.temperature, top_k=sp.top_k, top_p=sp.top_p,
                max_tokens=sp.max_tokens, stop_token_ids=sp.stop_token_ids,
                min_tokens=sp.min_tokens, ignore_eos=sp.ignore_eos)
            self.state = engine.insert(group.prefix, self.state, slot, params)
            self._slots[slot] = _Running(group, group.next_sample)
            group.next_sample += 1
            if group.next_sample == sp.n:
                group.prefix = None  # free the prefix's device memory
                self._queue.popleft()

    def _prefilled(self, group: _Group, prefix: Prefix) -> None:
        group.prefix, group.prompt_experts = prefix, prefix.experts_LPK
        self.stats.prefills += 1
        self.stats.prompt_tokens += len(group.prompt)

    def _prefill_ahead(self) -> None:
        """Prefill together the prompts whose samples the free slots will take (an engine with
        `batched_prefill`): one batched forward instead of one per prompt."""
        free = sum(s is None for s in self._slots)
        todo = []
        for group in self._queue:
            if free <= 0:
                break
            free -= group.sampling.n - group.next_sample
            if group.prefix is None and group.adapter is None:
                todo.append(group)
        if len(todo) > 1:
            prefixes = self.engine.prefill_many(self.engine.params, [g.prompt for g in todo])
            for group, prefix in zip(todo, prefixes, strict=True):
                self._prefilled(group, prefix)

    def step(self) -> list[Completion]:
        """Refill free slots, run one decode chunk, return the samples that finished in it."""
        start = time.perf_counter()
        self.refill()
        if self.num_running == 0:
            return []
        waiting = bool(self._queue)
        min_finished = self.refill_threshold if waiting else None
        self.state, result = self.engine.generate_chunk(self.engine.params, self.state,
                                                        min_finished)
        out = self._harvest(jax.device_get(result))
        self.stats.busy_s += time.perf_counter() - start
        return out

    def _harvest(self, r) -> list[Completion]:
        steps = int(r.num_steps)
        self.stats.chunks += 1
        self.stats.decode_steps += steps
        self.stats.slot_steps += steps * self.engine.num_slots
        self.stats.active_slot_steps += int(r.valid_CB[1:].sum())
        done = []
        for slot, run in enumerate(self._slots):
            if run is None:
                continue
            rows = np.nonzero(r.valid_CB[:, slot])[0]
            before = len(run.tokens)
            run.tokens.extend(r.tokens_CB[rows, slot].tolist())
            run.logprobs.extend(r.logprobs_CB[rows, slot].tolist())
            run.versions.extend(r.versions_CB[rows, slot].tolist())
            if r.experts_CBLK is not None:  # rows > 0 routed the token fed at that step
                run.experts.extend(r.experts_CBLK[rows[rows > 0], slot])
            self.stats.generated_tokens += len(rows)
            g = run.group
            keep = g.stop_text.find(run.tokens, before) if g.stop_text is not None else None
            if keep is not None:  # a stop string of several tokens: end the sample there
                self.stats.generated_tokens -= len(run.tokens) - keep
                del run.tokens[keep:], run.logprobs[keep:], run.versions[keep:]
                del run.experts[keep:]
                if r.active_B[slot]:
                    self.state = self.engine.release(self.state, slot)
                reason = "stop"
            elif not r.active_B[slot]:
                reason = FINISH_REASONS.get(int(r.finish_reason_B[slot]))
                if reason is None:
                    raise RuntimeError(f"internal: slot {slot} inactive with no finish reason")
            if keep is not None or not r.active_B[slot]:
                done.append(Completion(g.request_id, run.sample_index, g.prompt, run.tokens,
                                       run.logprobs, run.versions, reason, run.routing()))
                self._slots[slot] = None
        self.stats.completions += len(done)
        return done

    def run(self) -> list[Completion]:
        """Step until the queue is empty and every slot is free; completions in finish order."""
        out = []
        while self.has_work():
            out.extend(self.step())
        return out
