"""Scores of the prompt beyond its own tokens' log-probabilities: `sample(...,
topk_prompt_logprobs=k)`, the k most likely next tokens and their log-probabilities at each
prompt position (the cookbook's SDFT and off-policy distillation read them as the teacher's soft
targets), and `sample(..., target_prompt_logprobs=ids)`, the log-probabilities of chosen ids at
chosen positions (the cookbook's `decisions` recipe scores its answer labels with them).

Row t of the answer is the model's distribution over token t given `prompt[:t]`, its k largest
entries in descending order: `log softmax(logits(prompt[:t]))`, the same forward (and the same
logits, soft cap included) as `prompt_logprobs`, whose value at t is this row's entry for
`prompt[t]`. Row 0 has no context and, with `prompt_logprobs_last_n=N`, so do the rows before
the last N: they hold the SDK's sentinel (token 0, log-probability -99999), which it reads as
None. On the wire: `SampleResponse.topk_prompt_logprobs` (`TopkLogprobs`: `[len(prompt), k]`
int32 ids and float32 log-probabilities, row-major), added to the encoded response.

`target_prompt_logprobs` is an int64 `[len(prompt) - 1, K]` tensor of ids, dense or sparse CSR
(`TensorData`): cell `[i, j]` asks for `log p(ids[i, j] | prompt[:i + 1])`, a cell of -1 asks
for nothing. The answer has the request's shape and layout (`SampleResponse.
target_prompt_logprobs`, float32; dense or CSR with the same row pointers and columns), NaN in a
cell that asked for nothing. `prompt_logprobs_last_n` does not apply to it (as the SDK says).
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


def _logp(graphdef, adapters, base, tokens_BT):
    model = nnx.merge(graphdef, lora.join(base, adapters))
    return jax.nn.log_softmax(model.logits(model.hidden(tokens_BT)), axis=-1)


@functools.cache
def _jit_topk(graphdef, k: int):
    return jax.jit(lambda *args: jax.lax.top_k(_logp(graphdef, *args), k))


@functools.cache
def _jit_gather(graphdef):
    """log p of `ids_BTK` (clipped to the vocabulary: the caller masks -1) at each position."""
    return jax.jit(lambda adapters, base, tokens_BT, ids_BTK: jnp.take_along_axis(
        _logp(graphdef, adapters, base, tokens_BT), jnp.maximum(ids_BTK, 0), axis=-1))


def _padded(prompt: list[int]) -> np.ndarray:
    tokens = np.zeros((1, next_power_of_two(len(prompt), minimum=16)), np.int32)
    tokens[0, :len(prompt)] = prompt
    return tokens


def prompt_topk(backend, snap, prompt: list[int], k: int, start: int = 1
                ) -> tuple[np.ndarray, np.ndarray]:
    """(ids `[len(prompt), k]` int32, log-probabilities float32): row t the k most likely
    tokens after `prompt[:t]`; rows before `max(start, 1)` the sentinel."""
    graphdef = backend.base_graphdef if snap is None else snap.graphdef
    adapters = {} if snap is None else snap.adapters
    n = len(prompt)
    logp, ids = _jit_topk(graphdef, k)(adapters, backend.base, jnp.asarray(_padded(prompt)))
    out_ids = np.zeros((n, k), np.int32)
    out_logp = np.full((n, k), MASK_LOGPROB, np.float32)
    first = max(start, 1)  # position t is predicted from position t - 1's logits
    out_ids[first:] = np.asarray(ids)[0, first - 1:n - 1]
    out_logp[first:] = np.asarray(logp)[0, first - 1:n - 1]
    return out_ids, out_logp


def requested_targets(body: dict, prompt_len: int, vocab_size: int) -> dict | None:
    """The request's `target_prompt_logprobs` as {"ids": dense `[prompt_len - 1, K]` int64
    (-1: nothing), "csr": (row pointers, columns) or None}, checked; None: not asked for."""
    t = body.get("target_prompt_logprobs")
    if t is None:
        return None
    what = "sample: target_prompt_logprobs"
    if not isinstance(t, dict) or t.get("dtype") != "int64":
        raise UserError(f"{what} must be an int64 TensorData of token ids, got {t!r:.200}")
    shape = t.get("shape")
    if not (isinstance(shape, list) and len(shape) == 2 and shape[0] == prompt_len - 1
            and isinstance(shape[1], int) and 1 <= shape[1] <= MAX_K):
        raise UserError(f"{what} must have shape [len(prompt) - 1, K] = [{prompt_len - 1}, K] "
                        f"with K in 1..{MAX_K}, got {shape!r}")
    data = np.asarray(t.get("data", []), np.int64)
    crow, col = t.get("sparse_crow_indices"), t.get("sparse_col_indices")
    try:
        if crow is None:
            ids, csr = data.reshape(shape), None
        else:
            crow, col = np.asarray(crow, np.int64), np.asarray(col, np.int64)
            ids = np.full(shape, -1, np.int64)
            rows = np.repeat(np.arange(shape[0]), np.diff(crow))
            ids[rows, col] = data
            csr = (crow, col)
    except (ValueError, IndexError) as e:
        raise UserError(f"{what}: data, sparse_crow_indices and sparse_col_indices do not make "
                        f"a tensor of shape {shape} ({e})") from e
    if ids.size and (ids.min() < -1 or ids.max() >= vocab_size):
        raise UserError(f"{what}: ids must be in [0, {vocab_size}) or -1 (nothing)")
    return {"ids": ids, "csr": csr}


def target_logprobs(backend, snap, prompt: list[int], ids: np.ndarray) -> np.ndarray:
    """`[len(prompt) - 1, K]` float32: log p(ids[i, j] | prompt[:i + 1]); NaN where ids is
    -1."""
    graphdef = backend.base_graphdef if snap is None else snap.graphdef
    adapters = {} if snap is None else snap.adapters
    tokens = _padded(prompt)
    ids_btk = np.zeros((1, tokens.shape[1], ids.shape[1]), np.int32)
    ids_btk[0, :len(ids)] = ids
    got = np.asarray(_jit_gather(graphdef)(adapters, backend.base, jnp.asarray(tokens),
                                           jnp.asarray(ids_btk)))[0, :len(ids)]
    return np.where(ids < 0, np.nan, got).astype(np.float32)


def with_scores(response: bytes, backend, snap, prompt: list[int], k: int | None,
                start: int | None, targets: dict | None = None) -> bytes:
    """An encoded `SampleResponse` with the prompt's top-k (`k`; `start`: the first scored
    position, `prompt_logprobs_last_n`, None: all) and target log-probabilities (`targets`,
    `requested_targets`) added; unchanged when neither was asked for."""
    if k is None and targets is None:
        return response
    msg = pb.SampleResponse.FromString(response)
    if k is not None:
        ids, logp = prompt_topk(backend, snap, prompt, k, 1 if start is None else start)
        msg.topk_prompt_logprobs.CopyFrom(pb.TopkLogprobs(
            token_ids=ids.tobytes(), logprobs=logp.tobytes(), k=k, length=len(prompt)))
    if targets is not None:
        logp = target_logprobs(backend, snap, prompt, targets["ids"])
        tensor = pb.Tensor(dtype=pb.DTYPE_FLOAT32, shape=list(logp.shape))
        if targets["csr"] is None:
            tensor.dense = logp.tobytes()
        else:
            crow, col = targets["csr"]
            rows = np.repeat(np.arange(len(logp)), np.diff(crow))
            tensor.sparse_csr.CopyFrom(pb.SparseCsr(values=logp[rows, col].tobytes(),
                                                    crow_indices=crow.tobytes(),
                                                    col_indices=col.tobytes()))
        msg.target_prompt_logprobs.CopyFrom(tensor)
    return msg.SerializeToString()
