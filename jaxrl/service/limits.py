"""What one request may ask of the service, checked when it arrives, before any model work.

`Limits` holds the caps (`launch/serve.py` flags): the body size (checked from Content-Length
before the body is read, and while it is read), the samples per request, `max_tokens` per sample,
the LoRA rank. The model's `max_len` bounds each prompt + `max_tokens`. `SampleRequest.parse`
turns a `/asample` JSON body into checked values. Every refusal is a `UserError` (HTTP 400)
naming the limit and the value received.
"""

from __future__ import annotations

import dataclasses
import json
import os

from jaxrl.generate.sampling import SamplingParams
from jaxrl.service.backend import UserError

MB = 2**20


@dataclasses.dataclass(frozen=True)
class Limits:
    """`max_sample_tokens` None: the model's `max_len` is the only bound on `max_tokens`."""

    max_body_bytes: int = 32 * MB
    max_num_samples: int = 256
    max_sample_tokens: int | None = None
    max_lora_rank: int = 128

    def __post_init__(self):
        for name in ("max_body_bytes", "max_num_samples", "max_lora_rank"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"Limits.{name} must be an integer >= 1, got {value!r}")
        if self.max_sample_tokens is not None and (not isinstance(self.max_sample_tokens, int)
                                                   or self.max_sample_tokens < 1):
            raise ValueError(f"Limits.max_sample_tokens must be None or an integer >= 1, got "
                             f"{self.max_sample_tokens!r}")

    def check_body_size(self, size: int | None) -> None:
        if size is not None and size > self.max_body_bytes:
            raise UserError(self.too_large(f"request body of {size} bytes"))

    def too_large(self, what: str) -> str:
        return (f"{what} exceeds the server's limit of {self.max_body_bytes} bytes "
                f"(--max-request-mb {self.max_body_bytes / MB:g})")

    def check_rank(self, rank) -> None:
        if isinstance(rank, int) and rank > self.max_lora_rank:
            raise UserError(f"lora rank {rank} exceeds the server's limit of "
                            f"{self.max_lora_rank} (--max-lora-rank)")


def json_object(body: bytes, route: str) -> dict:
    """A request body that must be a JSON object."""
    try:
        value = json.loads(body)
    except (UnicodeDecodeError, json.JSONDecodeError) as e:
        raise UserError(f"{route}: the request body is not valid JSON ({e})") from e
    if not isinstance(value, dict):
        raise UserError(f"{route}: the request body must be a JSON object, got a JSON "
                        f"{_json_kind(value)}")
    return value


def _json_kind(value) -> str:
    kinds = {list: "array", str: "string", int: "number", float: "number", bool: "boolean"}
    return "null" if value is None else kinds.get(type(value), type(value).__name__)


@dataclasses.dataclass(frozen=True)
class SampleRequest:
    prompt: list[int]
    params: SamplingParams
    stop: tuple[str, ...]

    @classmethod
    def parse(cls, body: dict, limits: Limits, max_len: int, vocab_size: int) -> SampleRequest:
        chunks = (body.get("prompt") or {}).get("chunks")
        if not isinstance(chunks, list):
            raise UserError("sample: prompt.chunks must be a list of token chunks")
        prompt = [t for c in chunks for t in _chunk_tokens(c)]
        if not prompt or len(prompt) >= max_len:
            raise UserError(f"sample: prompt of {len(prompt)} tokens; this server takes 1 to "
                            f"{max_len - 1} (max_len {max_len}, one token left to sample)")
        if not all(isinstance(t, int) and 0 <= t < vocab_size for t in prompt):
            bad = next(t for t in prompt if not (isinstance(t, int) and 0 <= t < vocab_size))
            raise UserError(f"sample: prompt token {bad!r} is outside the vocabulary "
                            f"[0, {vocab_size})")
        n = body.get("num_samples", 1)
        if not isinstance(n, int) or n < 1:
            raise UserError(f"sample: num_samples must be an integer >= 1, got {n!r}")
        if n > limits.max_num_samples:
            raise UserError(f"sample: num_samples {n} exceeds the server's limit of "
                            f"{limits.max_num_samples} (--max-num-samples)")
        sp = body.get("sampling_params") or {}
        if not isinstance(sp, dict):
            raise UserError(f"sample: sampling_params must be an object, got {sp!r}")
        max_tokens = sp.get("max_tokens")
        if max_tokens is not None:
            if not isinstance(max_tokens, int) or max_tokens < 1:
                raise UserError(f"sample: max_tokens must be an integer >= 1, got "
                                f"{max_tokens!r}")
            cap = limits.max_sample_tokens
            if cap is not None and max_tokens > cap:
                raise UserError(f"sample: max_tokens {max_tokens} exceeds the server's limit "
                                f"of {cap} (--max-sample-tokens)")
            if len(prompt) + max_tokens > max_len:
                raise UserError(f"sample: prompt of {len(prompt)} tokens + max_tokens "
                                f"{max_tokens} = {len(prompt) + max_tokens} exceeds the "
                                f"server's max_len {max_len} (--max-len)")
        return cls(prompt, sampling_params(sp, n, len(prompt), max_len, limits),
                   stop_strings(sp))


def _chunk_tokens(chunk) -> list:
    if not isinstance(chunk, dict) or chunk.get("type", "encoded_text") != "encoded_text":
        kind = chunk.get("type") if isinstance(chunk, dict) else type(chunk).__name__
        raise UserError(f"model input chunks of type {kind!r} are not supported (token chunks "
                        "only)")
    tokens = chunk.get("tokens")
    if not isinstance(tokens, list):
        raise UserError(f"sample: a chunk's tokens must be a list of ints, got {tokens!r:.40}")
    return tokens


def stop_strings(sp: dict) -> tuple[str, ...]:
    """The stop strings of the SDK's `SamplingParams.stop` (a string or a list of them; () for
    None or token ids)."""
    stop = sp.get("stop")
    stop = [stop] if isinstance(stop, str) else stop
    if not isinstance(stop, list) or not any(isinstance(s, str) for s in stop):
        return ()
    if not all(isinstance(s, str) and s for s in stop):
        raise UserError(f"sample: stop must be token ids or non-empty strings, not a mix; got "
                        f"{stop!r}")
    return tuple(stop)


def sampling_params(sp: dict, n: int, prompt_len: int, max_len: int,
                    limits: Limits | None = None) -> SamplingParams:
    """The SDK's `SamplingParams` as jaxrl's. `stop`: None keeps EOS; `[]` samples through it;
    token ids stop there; stop strings (`stop_strings`: checked on the decoded text by the
    scheduler) keep EOS as a stop too. `max_tokens` None: up to 128, within the limits."""
    stop = sp.get("stop")
    if stop_strings(sp):
        stop = None
    max_tokens = sp.get("max_tokens")
    if max_tokens is None:
        max_tokens = max(1, min(128, max_len - prompt_len,
                             (limits and limits.max_sample_tokens) or 128))
    seed = sp.get("seed")
    seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
    top_k = int(sp.get("top_k", -1))
    try:
        return SamplingParams(
            max_tokens=int(max_tokens), temperature=float(sp.get("temperature", 1)),
            top_k=0 if top_k < 0 else top_k, top_p=float(sp.get("top_p", 1)), n=n, seed=seed,
            stop_token_ids=tuple(stop or ()), ignore_eos=stop == [])
    except (TypeError, ValueError) as e:
        raise UserError(f"sample: {e}") from e
