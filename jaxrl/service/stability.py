"""Stability records: what `stable_reinforce` needs from sampling time (Tinker's
`record_stability_info`).

A sample request sent with `record_stability_info=True` records, per returned sequence, under
the `sequence_id` the SDK hands back (`SampledSequence.sequence_id`): the request's prompt, the
sampled tokens and the sampler's log-probability of each. A record belongs to the key that
sampled it and lasts one day after its last use (`TTL_S`; a training request that names it
restarts the day, as Tinker's docs say). Records live in memory: they do not survive a restart.

A `stable_reinforce` request names the records through each datum's provenance
(`Datum.with_provenance`): runs that tile its input tokens (`model_input_spans`) and its
`target_tokens` (`loss_fn_input_spans`), each `(kind, sequence_id, offset, length)` claiming
positions `[offset, offset + length)` of the sequence's prompt (`"prompt"`) or sampled tokens
(`"sampled"`). `attach` checks every claim against the records (the tokens must be the
recorded ones) and fills the loss's server-side inputs per target position:
`recorded_logprobs` (the sampler's, 0 on prompt positions) and `sampled` (1 on sampled
positions). The targets of prompt runs are not compared (tinker-cookbook sends 0 there). An
unknown, expired or another key's `sequence_id`, or a claim the record does not bear out, is
a `UserError` (HTTP 400) naming it.
"""

from __future__ import annotations

import collections
import dataclasses
import threading
import time

import numpy as np

from jaxrl.service.backend import UserError
from jaxrl.train.tinker import SERVER_INPUTS

TTL_S = 24 * 3600.0  # one day after the last use
EXPIRED_KEPT = 100_000  # expired ids remembered, to say "expired" rather than "unknown"


@dataclasses.dataclass
class Record:
    owner: str | None
    prompt: np.ndarray  # int32 [P]: the request's prompt
    tokens: np.ndarray  # int32 [S]: the sampled tokens
    logprobs: np.ndarray  # f32 [S]: the sampler's log-probability of each


class StabilityRecords:
    """`sequence_id -> Record`, oldest use first; thread-safe (the worker records, the event
    loop attaches). `clock`: seconds (monotonic), replaceable in tests."""

    def __init__(self, ttl_s: float = TTL_S, clock=time.monotonic):
        self.ttl_s, self.clock = ttl_s, clock
        self._records: collections.OrderedDict[str, tuple[Record, float]] = (
            collections.OrderedDict())
        # expired id -> its owner
        self._expired: collections.OrderedDict[str, str | None] = collections.OrderedDict()
        self._lock = threading.Lock()

    def __len__(self) -> int:
        with self._lock:
            self._purge()
            return len(self._records)

    def record(self, sequence_ids, owner, prompt, completions) -> None:
        """One record per `(tokens, logprobs)` of `completions`, under `sequence_ids`."""
        prompt = np.asarray(prompt, np.int32)
        with self._lock:
            self._purge()
            now = self.clock()
            for sid, (tokens, logprobs) in zip(sequence_ids, completions, strict=True):
                self._records[sid] = (Record(owner, prompt, np.asarray(tokens, np.int32),
                                             np.asarray(logprobs, np.float32)), now)

    def attach(self, loss_fn: str, data, owner) -> None:
        """Fill each datum's server-side inputs of `loss_fn` from its provenance (see the
        module); every record named is then used (its day restarts). Nothing for other
        losses."""
        if loss_fn not in SERVER_INPUTS:
            return
        with self._lock:
            self._purge()
            used = set()
            for i, d in enumerate(data):
                for key in SERVER_INPUTS[loss_fn]:
                    if key in d.inputs:
                        raise UserError(f"datum {i}: loss_fn_inputs {key!r} is filled by the "
                                        "server from the datum's provenance; do not send it")
                if d.spans is None:
                    raise UserError(
                        f"datum {i}: loss_fn {loss_fn} needs provenance on every datum "
                        "(Datum.with_provenance, naming the sequence_ids of a sampling client "
                        "made with record_stability_info=True); this datum has none")
                model_spans, loss_spans = d.spans
                self._check(i, "model_input", model_spans, d.tokens, used, owner)
                d.inputs.update(self._check(i, "target_tokens", loss_spans,
                                            d.inputs["target_tokens"], used, owner))
            now = self.clock()
            for sid in used:
                self._records[sid] = (self._records[sid][0], now)
                self._records.move_to_end(sid)

    def _check(self, i, field, spans, tokens, used, owner) -> dict[str, np.ndarray]:
        """Check that `spans` tile `tokens` with the tokens their records hold (all of
        model_input; of target_tokens the sampled runs only: tinker-cookbook sends 0 as the
        target of a prompt position, which no loss reads); the per-position `recorded_logprobs`
        and `sampled` they imply."""
        n = len(tokens)
        total = sum(length for _, _, _, length in spans)
        if total != n:
            raise UserError(f"datum {i}: its {field} provenance spans cover {total} positions "
                            f"but {field} has {n}; the runs must tile it exactly")
        logprobs, sampled = np.zeros(n, np.float32), np.zeros(n, np.float32)
        pos = 0
        for kind, sid, offset, length in spans:
            rec = self._get(sid, owner)
            source = rec.tokens if kind == "sampled" else rec.prompt
            if offset + length > len(source):
                raise UserError(f"datum {i}: a {kind} provenance span of {field} claims "
                                f"positions {offset}..{offset + length - 1} of sequence {sid!r},"
                                f" whose {kind} tokens number {len(source)}")
            checked = kind == "sampled" or field == "model_input"
            if checked and not np.array_equal(source[offset:offset + length],
                                              tokens[pos:pos + length]):
                raise UserError(f"datum {i}: {field} positions {pos}..{pos + length - 1} are not "
                                f"the {kind} tokens {offset}..{offset + length - 1} of sequence "
                                f"{sid!r} that its provenance names")
            if kind == "sampled":
                logprobs[pos:pos + length] = rec.logprobs[offset:offset + length]
                sampled[pos:pos + length] = 1.0
            used.add(sid)
            pos += length
        return {"recorded_logprobs": logprobs, "sampled": sampled}

    def _get(self, sid: str, owner) -> Record:
        found = self._records.get(sid)
        if found is not None and found[0].owner == owner:
            return found[0]
        if sid in self._expired and self._expired[sid] == owner:
            raise UserError(f"sequence_id {sid!r} has expired: stability records last one day "
                            "after their last use")
        # another key's record answers as an unknown one: a key learns nothing of another's
        raise UserError(f"unknown sequence_id {sid!r}: no sequence of yours was sampled under "
                        "it with record_stability_info=True (records do not survive a server "
                        "restart)")

    def _purge(self) -> None:
        cutoff = self.clock() - self.ttl_s
        while self._records:
            sid, (rec, last) = next(iter(self._records.items()))
            if last > cutoff:
                break
            del self._records[sid]
            self._expired[sid] = rec.owner
            if len(self._expired) > EXPIRED_KEPT:
                self._expired.popitem(last=False)
