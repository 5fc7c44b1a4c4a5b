"""`sample(..., topk_prompt_logprobs=k)`: the k most likely next tokens, and their
log-probabilities, at each prompt position (the cookbook's SDFT and off-policy distillation
read them as the teacher's soft targets).

Row t of the answer is the model's distribution over token t given `prompt[:t]`, its k largest
entries in descending order: `log softmax(logits(prompt[:t]))`, the same forward (and the same
logits, soft cap included) as `prompt_logprobs`, whose value at t is this row's entry for
`prompt[t]`. Row 0 has no context and, with `prompt_logprobs_last_n=N`, so do the rows before
the last N: they hold the SDK's sentinel (token 0, log-probability -99999), which it reads as
None. On the wire: `SampleResponse.topk_prompt_logprobs` (`TopkLogprobs`: `[len(prompt), k]`
int32 ids and float32 log-probabilities, row-major), added to the encoded response.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from tinker.proto import tinker_public_pb2 as pb

from jaxrl.models import lora
from jaxrl.rounding import next_power_of_two
from jaxrl.service.backend import UserError

MASK_LOGPROB = -99999.0  # the SDK's value of an empty row (`tinker.types.topk_logprobs`)
MAX_K = 1024  # the answer is len(prompt) x k x 8 bytes


def requested_k(body: dict, vocab_size: int) -> int | None:
    """The request's `topk_prompt_logprobs` (None: not asked for), checked."""
    k, most = body.get("topk_prompt_logprobs") or 0, min(MAX_K, vocab_size)
    if isinstance(k, bool) or not isinstance(k, int) or not 0 <= k <= most:
        raise UserError(f"sample: topk_prompt_logprobs must be an integer in 0..{most} (the "
                        f"vocabulary size, at most {MAX_K}), got {k!r}")
    return k or None


@functools.cache
def _jit_topk(graphdef, k: int):
    def fn(adapters, base, tokens_BT):
        model = nnx.merge(graphdef, lora.join(base, adapters))
        logp_BTV = jax.nn.log_softmax(model.logits(model.hidden(tokens_BT)), axis=-1)
        return jax.lax.top_k(logp_BTV, k)

    return jax.jit(fn)


def prompt_topk(backend, snap, prompt: list[int], k: int, start: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
    """(ids `[len(prompt), k]` int32, log-probabilities float32): row t the k most likely
    tokens after `prompt[:t]`; rows before `max(start, 1)` the sentinel."""
    graphdef = backend.base_graphdef if snap is None else snap.graphdef
    adapters = {} if snap is None else snap.adapters
    n = len(prompt)
    tokens = np.zeros((1, next_power_of_two(n, minimum=16)), np.int32)
    tokens[0, :n] = prompt
    logp, ids = _jit_topk(graphdef, k)(adapters, backend.base, jnp.asarray(tokens))
    out_ids = np.zeros((n, k), np.int32)
    out_logp = np.full((n, k), MASK_LOGPROB, np.float32)
    first = max(start, 1)  # position t is predicted from position t - 1's logits
    out_ids[first:] = np.asarray(ids)[0, first - 1:n - 1]
    out_logp[first:] = np.asarray(logp)[0, first - 1:n - 1]
    return out_ids, out_logp


def with_topk(response: bytes, backend, snap, prompt: list[int], k: int | None,
              start: int | None) -> bytes:
    """An encoded `SampleResponse` with the prompt's top-k added (unchanged when k is None).
    `start`: the first scored position (`prompt_logprobs_last_n`; None: all)."""
    if k is None:
        return response
    ids, logp = prompt_topk(backend, snap, prompt, k, 1 if start is None else start)
    msg = pb.SampleResponse.FromString(response)
    msg.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(
        token_ids=ids.tobytes(), logprobs=logp.tobytes(), k=k, length=len(prompt)))
    return msg.SerializeToString()
