"""Per-token log-probabilities without materialising [B, T, V] logits at once.

The lm head and log-softmax run over chunks of the sequence (`lax.map` over T / chunk pieces),
each chunk under `jax.checkpoint`, so forward AND backward hold at most [B, chunk, V] logits.

Alignment (see `jaxrl.train.batch`): the hidden state at position t-1 predicts `tokens[:, t]`;
the result `logp_BT[:, t] = log pi(tokens[:, t] | tokens[:, :t])` is 0 at t = 0 and wherever
position t starts a new segment or is padding (no prediction within the segment exists).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.train.batch import Batch

REMAT_POLICIES = {
    "dots": jax.checkpoint_policies.checkpoint_dots,
    "dots_no_batch": jax.checkpoint_policies.checkpoint_dots_with_no_batch_dims,
}


def chunk_size(length: int, chunk: int) -> int:
    """The largest divisor of `length` that is <= `chunk` (padded lengths make this `chunk`)."""
    c = min(chunk, length)
    while length % c:
        c -= 1
    return c


def logprobs_from_hidden(logits_fn, h_BTE, tokens_BT, segment_ids_BT, *, chunk: int):
    """(logp_BT, entropy_BT) of `tokens` under logits = `logits_fn(h)`; entropy has no gradient.

    `entropy_BT[:, t]` is the entropy of the distribution that predicted token t (same alignment).
    """
    b, t, e = h_BTE.shape
    c = chunk_size(t, chunk)
    n = t // c
    # target of position t is token t+1; the last position has none (masked below).
    tgt_BT = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros_like(tokens_BT[:, :1])], axis=1)

    @jax.checkpoint
    def one_chunk(args):
        h_BcE, tgt_Bc = args
        logits_BcV = logits_fn(h_BcE).astype(jnp.float32)
        lse_Bc = jax.nn.logsumexp(logits_BcV, axis=-1)
        tgt_logit_Bc = jnp.take_along_axis(logits_BcV, tgt_Bc[..., None], axis=-1)[..., 0]
        z = jax.lax.stop_gradient(logits_BcV)
        ent_Bc = jax.lax.stop_gradient(lse_Bc) - jnp.sum(jax.nn.softmax(z, axis=-1) * z, axis=-1)
        return tgt_logit_Bc - lse_Bc, ent_Bc

    h_NBcE = h_BTE.reshape(b, n, c, e).swapaxes(0, 1)
    tgt_NBc = tgt_BT.reshape(b, n, c).swapaxes(0, 1)
    if n == 1:
        lp_next_BT, ent_next_BT = one_chunk((h_BTE, tgt_BT))
    else:
        lp_NBc, ent_NBc = jax.lax.map(one_chunk, (h_NBcE, tgt_NBc))
        lp_next_BT = lp_NBc.swapaxes(0, 1).reshape(b, t)
        ent_next_BT = ent_NBc.swapaxes(0, 1).reshape(b, t)
    # shift right: the prediction made at t-1 belongs to token t.
    zero_B1 = jnp.zeros((b, 1), jnp.float32)
    logp_BT = jnp.concatenate([zero_B1, lp_next_BT[:, :-1]], axis=1)
    ent_BT = jnp.concatenate([zero_B1, ent_next_BT[:, :-1]], axis=1)
    prev_BT = jnp.concatenate([jnp.zeros_like(segment_ids_BT[:, :1]), segment_ids_BT[:, :-1]], 1)
    scored_BT = (segment_ids_BT > 0) & (segment_ids_BT == prev_BT)
    return jnp.where(scored_BT, logp_BT, 0.0), jnp.where(scored_BT, ent_BT, 0.0)


def model_logprobs(model, batch: Batch, *, chunk: int, remat: str = "none"):
    """(logp_BT, entropy_BT) of `batch.tokens` under an NNX `Transformer` (traceable)."""

    def hidden(m, tokens, positions, segment_ids):
        return m.hidden(tokens, positions, segment_ids)

    if remat in REMAT_POLICIES:
        hidden = nnx.remat(hidden, policy=REMAT_POLICIES[remat])
    h_BTE = hidden(model, batch.tokens, batch.positions, batch.segment_ids)
    return logprobs_from_hidden(model.logits, h_BTE, batch.tokens, batch.segment_ids, chunk=chunk)


def _logprobs(params, batch: Batch, *, graphdef, chunk: int):
    model = nnx.merge(graphdef, params)
    logp_BT, _ = model_logprobs(model, batch, chunk=chunk)
    return logp_BT


@functools.cache
def make_logprobs_fn(graphdef, *, chunk: int, out_sharding=None):
    """Jitted `logprobs(params, batch) -> logp_BT` (f32, aligned as above) on the params' mesh.

    Used for the proximal policy (current params before an update) and the reference policy."""
    fn = functools.partial(_logprobs, graphdef=graphdef, chunk=chunk)
    return jax.jit(fn, out_shardings=out_sharding)


def full_logprobs_reference(model, batch: Batch):
    """Unchunked reference (materialises [B, T, V]); for tests only."""
    logits_BTV = model(batch.tokens, batch.positions, batch.segment_ids).astype(jnp.float32)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    lp_BT = jnp.take_along_axis(logp_BTV[:, :-1], batch.tokens[:, 1:, None], axis=-1)[..., 0]
    seg = batch.segment_ids
    ok_BT = (seg[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1])
    lp_BT = jnp.where(ok_BT, lp_BT, 0.0)
    return jnp.concatenate([jnp.zeros_like(lp_BT[:, :1]), lp_BT], axis=1)
