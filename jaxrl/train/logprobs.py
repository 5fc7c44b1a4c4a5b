"""Per-token log-probabilities without materialising [B, T, V] logits at once.

The lm head and log-softmax run over chunks of the sequence (`lax.map` / `lax.scan` over T / chunk
pieces) inside a custom VJP, so forward AND backward compute at most [B, chunk, V] logits at once
(the backward may keep the forward's softmax when it fits a budget; see `logprobs_from_hidden`).

Alignment (see `jaxrl.train.batch`): the hidden state at position t-1 predicts `tokens[:, t]`;
the result `logp_BT[:, t] = log pi(tokens[:, t] | tokens[:, :t])` is 0 at t = 0 and wherever
position t starts a new segment or is padding (no prediction within the segment exists).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models.moe import routing_mismatch
from jaxrl.models.shared_prefix import shared_prefix_hidden
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


def _head_logits(h_BcE, w_EV, softcap=None):
    """Logits of a chunk, soft-capped (`cap * tanh(z / cap)`, Gemma 2) when `softcap` is set."""
    z_BcV = jnp.einsum("bce,ev->bcv", h_BcE, w_EV, preferred_element_type=jnp.float32)
    return z_BcV if softcap is None else softcap * jnp.tanh(z_BcV / softcap)


def _to_chunks(x, n):  # [B, T, ...] -> [N, B, T/N, ...]
    return x.reshape(x.shape[0], n, x.shape[1] // n, *x.shape[2:]).swapaxes(0, 1)


def _from_chunks(x):  # [N, B, c, ...] -> [B, N c, ...]
    x = x.swapaxes(0, 1)
    return x.reshape(x.shape[0], x.shape[1] * x.shape[2], *x.shape[3:])


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6))
def _chunked_logp_entropy(h_BTE, w_EV, tgt_BT, chunk: int, keep_probs: bool, entropy_grad: bool,
                          softcap: float | None):
    """(log softmax(h w)[tgt], entropy) per position, `chunk` positions of logits at a time."""
    return _chunked_fwd(h_BTE, w_EV, tgt_BT, chunk, keep_probs, entropy_grad, softcap)[0]


def _chunked_fwd(h_BTE, w_EV, tgt_BT, chunk, keep_probs, entropy_grad, softcap):
    n = h_BTE.shape[1] // chunk

    def one(args):
        h_BcE, tgt_Bc = args
        z_BcV = _head_logits(h_BcE, w_EV, softcap)
        lse_Bc = jax.nn.logsumexp(z_BcV, axis=-1)
        tgt_logit_Bc = jnp.take_along_axis(z_BcV, tgt_Bc[..., None], axis=-1)[..., 0]
        p_BcV = jnp.exp(z_BcV - lse_Bc[..., None])
        ent_Bc = lse_Bc - jnp.sum(p_BcV * z_BcV, axis=-1)
        return tgt_logit_Bc - lse_Bc, ent_Bc, (p_BcV if keep_probs else lse_Bc)

    lp, ent, kept = jax.lax.map(one, (_to_chunks(h_BTE, n), _to_chunks(tgt_BT, n)))
    return (_from_chunks(lp), _from_chunks(ent)), (h_BTE, w_EV, tgt_BT, kept)


def _chunked_bwd(chunk, keep_probs, entropy_grad, softcap, residuals, cotangents):
    """d logp / d logits = onehot(tgt) - softmax, with the softmax kept from the forward or
    recomputed from each chunk's logits and log-normaliser; dW accumulates over chunks in f32.
    With `entropy_grad`, the entropy's cotangent adds dH / dz_v = -p_v (log p_v + H) (an entropy
    bonus in the loss); without it the entropy output carries no gradient. Soft-capped logits
    `z = c tanh(u / c)` of the raw `u = h w` carry dz / du = 1 - (z / c)^2 (the capped logits
    are then recomputed from each chunk, never kept)."""
    h_BTE, w_EV, tgt_BT, kept_N = residuals
    g_BT, gh_BT = cotangents
    n = h_BTE.shape[1] // chunk

    def one(dw_EV, args):
        h_BcE, tgt_Bc, kept, g_Bc, gh_Bc = args
        if keep_probs:
            p_BcV = kept
            logp_BcV = jnp.log(jnp.maximum(p_BcV, jnp.finfo(jnp.float32).tiny))
        else:
            z_BcV = _head_logits(h_BcE, w_EV, softcap)
            logp_BcV = z_BcV - kept[..., None]
            p_BcV = jnp.exp(logp_BcV)
        onehot_BcV = jnp.arange(p_BcV.shape[-1])[None, None, :] == tgt_Bc[..., None]
        dz_BcV = g_Bc[..., None] * (onehot_BcV - p_BcV)
        if entropy_grad:
            ent_Bc = -jnp.sum(p_BcV * logp_BcV, axis=-1)
            dz_BcV = dz_BcV - gh_Bc[..., None] * p_BcV * (logp_BcV + ent_Bc[..., None])
        if softcap is not None:
            dz_BcV = dz_BcV * (1.0 - jnp.square(z_BcV / softcap))
        dz_BcV = dz_BcV.astype(h_BcE.dtype)
        dh_BcE = jnp.einsum("bcv,ev->bce", dz_BcV, w_EV, preferred_element_type=jnp.float32)
        dw_EV = dw_EV + jnp.einsum("bce,bcv->ev", h_BcE, dz_BcV, preferred_element_type=jnp.float32)
        return dw_EV, dh_BcE.astype(h_BcE.dtype)

    xs = (_to_chunks(h_BTE, n), _to_chunks(tgt_BT, n), kept_N, _to_chunks(g_BT, n),
          _to_chunks(gh_BT, n))
    dw_EV, dh_NBcE = jax.lax.scan(one, jnp.zeros(w_EV.shape, jnp.float32), xs)
    return _from_chunks(dh_NBcE), dw_EV.astype(w_EV.dtype), None


_chunked_logp_entropy.defvjp(_chunked_fwd, _chunked_bwd)


def target_logprobs(w_EV, h_BTE, targets_BT, *, chunk: int, keep_probs_mb: float = 0.0,
                    entropy_grad: bool = False, softcap: float | None = None):
    """(logp_BT, entropy_BT) predicted AT each position, `logp_BT[:, t] = log softmax(h_BTE[:, t]
    @ w_EV)[targets_BT[:, t]]`, unshifted and unmasked (the Tinker service's `target_tokens`):
    the chunked pass of `logprobs_from_hidden`, same `chunk` / `keep_probs_mb` / `entropy_grad`
    / `softcap`."""
    b, t, _ = h_BTE.shape
    keep_probs = softcap is None and b * t * w_EV.shape[-1] * 4 <= keep_probs_mb * 2**20
    logp_BT, ent_BT = _chunked_logp_entropy(h_BTE, w_EV, targets_BT, chunk_size(t, chunk),
                                            keep_probs, entropy_grad, softcap)
    return logp_BT, (ent_BT if entropy_grad else jax.lax.stop_gradient(ent_BT))


def logprobs_from_hidden(w_EV, h_BTE, tokens_BT, segment_ids_BT, *, chunk: int,
                         keep_probs_mb: float = 0.0, entropy_grad: bool = False,
                         softcap: float | None = None):
    """(logp_BT, entropy_BT) of `tokens` under logits = `h_BTE @ w_EV` (the lm head, see
    `Transformer.head_weight`), soft-capped by `softcap` (`ModelConfig.final_logit_softcap`,
    as `Transformer.logits`); entropy has a gradient only with `entropy_grad` (an entropy
    bonus), else it is a statistic.

    `entropy_BT[:, t]` is the entropy of the distribution that predicted token t (same alignment).
    The lm head runs `chunk` positions at a time inside a custom VJP, so the forward never holds
    more than [B, chunk, V] logits, and the entropy (a statistic) is not replayed in the backward
    pass, as it was under `jax.checkpoint` (measured on CPU: lm head + loss forward and backward
    1.53 s vs 1.72-1.91 s per 4 x 512 tokens, vocabulary 32000).

    For the backward the forward keeps either the softmax itself, when its [B, T, V] f32 takes at
    most `keep_probs_mb` MiB (saves the backward one lm-head matmul: the 40M benchmark model's
    training step 14.6 -> 13.4 s on CPU), or else only the log-normaliser per position, and the
    backward recomputes each chunk's logits.
    """
    b = h_BTE.shape[0]
    # target of position t is token t+1; the last position has none (masked below).
    tgt_BT = jnp.concatenate([tokens_BT[:, 1:], jnp.zeros_like(tokens_BT[:, :1])], axis=1)
    lp_next_BT, ent_next_BT = target_logprobs(w_EV, h_BTE, tgt_BT, chunk=chunk,
                                              keep_probs_mb=keep_probs_mb,
                                              entropy_grad=entropy_grad, softcap=softcap)
    # shift right: the prediction made at t-1 belongs to token t.
    zero_B1 = jnp.zeros((b, 1), jnp.float32)
    logp_BT = jnp.concatenate([zero_B1, lp_next_BT[:, :-1]], axis=1)
    ent_BT = jnp.concatenate([zero_B1, ent_next_BT[:, :-1]], axis=1)
    prev_BT = jnp.concatenate([jnp.zeros_like(segment_ids_BT[:, :1]), segment_ids_BT[:, :-1]], 1)
    scored_BT = (segment_ids_BT > 0) & (segment_ids_BT == prev_BT)
    return jnp.where(scored_BT, logp_BT, 0.0), jnp.where(scored_BT, ent_BT, 0.0)


def model_logprobs(model, batch: Batch, *, chunk: int, remat: str = "none",
                   keep_probs_mb: float = 0.0, rope=None, entropy_grad: bool = False,
                   replay: bool = False):
    """(logp_BT, entropy_BT) of `batch.tokens` under an NNX `Transformer` (traceable); see
    `model_logprobs_routed`."""
    logp_BT, ent_BT, _ = model_logprobs_routed(
        model, batch, chunk=chunk, remat=remat, keep_probs_mb=keep_probs_mb, rope=rope,
        entropy_grad=entropy_grad, replay=replay)
    return logp_BT, ent_BT


def model_logprobs_routed(model, batch: Batch, *, chunk: int, remat: str = "none",
                          keep_probs_mb: float = 0.0, rope=None, entropy_grad: bool = False,
                          replay: bool = False):
    """(logp_BT, entropy_BT, routing stats) of `batch.tokens` under an NNX `Transformer`
    (traceable); see `logprobs_from_hidden` for `chunk` and `keep_probs_mb`,
    `Transformer.hidden` for `rope`.

    A mixture of experts with `replay` routes each token to the generator's experts
    (`batch.routed_experts`, routing replay; the router still weights them). The stats, when
    the batch carries a routing record: `moe/routing_mismatch` (fraction of (sparse layer,
    token) pairs whose expert set here differs from the generator's; 0 with replay),
    `moe/routing_mismatch_any_layer` (fraction of tokens differing in any sparse layer) and,
    with replay, `moe/router_mismatch` (the router's own top-k against the record: what the
    mismatch would be without replay). Real tokens with a record only."""
    recorded_BTLK = batch.routed_experts
    experts_LBTK = None
    if replay and recorded_BTLK is not None:
        experts_LBTK = jnp.transpose(recorded_BTLK, (2, 0, 1, 3))

    def hidden(m, tokens, positions, segment_ids, rope, experts):
        return m.hidden_routed(tokens, positions, segment_ids, rope=rope, experts_LBTK=experts)

    if remat in REMAT_POLICIES:
        hidden = nnx.remat(hidden, policy=REMAT_POLICIES[remat])
    h_BTE, routing = hidden(model, batch.tokens, batch.positions, batch.segment_ids, rope,
                            experts_LBTK)
    w_EV = model.head_weight(h_BTE.dtype)
    logp_BT, ent_BT = logprobs_from_hidden(w_EV, h_BTE, batch.tokens, batch.segment_ids,
                                           chunk=chunk, keep_probs_mb=keep_probs_mb,
                                           entropy_grad=entropy_grad,
                                           softcap=model.cfg.final_logit_softcap)
    stats = {}
    if routing is not None and recorded_BTLK is not None:
        ls, b, t, k = routing.experts_LBTK.shape
        used_LNK = routing.experts_LBTK.reshape(ls, b * t, k)
        rec_LNK = jnp.transpose(recorded_BTLK, (2, 0, 1, 3)).reshape(ls, b * t, k)
        valid_N = batch.segment_ids.reshape(-1) > 0
        pair, token = routing_mismatch(used_LNK, rec_LNK, valid_N)
        stats = {"moe/routing_mismatch": pair, "moe/routing_mismatch_any_layer": token}
        if replay:
            own_LNK = jax.lax.top_k(jax.lax.stop_gradient(routing.logits_LNX), k)[1]
            stats["moe/router_mismatch"] = routing_mismatch(own_LNK, rec_LNK, valid_N)[0]
    return logp_BT, ent_BT, stats


def _take(x_BT, index_BS):
    return jnp.take_along_axis(x_BT, jnp.maximum(index_BS, 0), axis=1)


def shared_logprobs(model, batch: Batch, layout, *, chunk: int,
                    remat: str = "none", keep_probs_mb: float = 0.0,
                    entropy_grad: bool = False):
    """`(logp_BT, entropy_BT)` of `batch.tokens` as `model_logprobs` gives them at every loss
    position, computed through the shared prefixes of a single `jaxrl.train.prefix.PrefixLayout`
    (`whole` or one micro-batch's slice); 0 at the prefix positions and padding."""
    valid_BS = layout.suffix_index_BS >= 0
    tokens_BS = _take(batch.tokens, layout.suffix_index_BS)
    positions_BS = _take(batch.positions, layout.suffix_index_BS)
    seg_BS = jnp.where(valid_BS, _take(batch.segment_ids, layout.suffix_index_BS), 0)
    hidden = shared_prefix_hidden
    if remat in REMAT_POLICIES:
        hidden = nnx.remat(hidden, policy=REMAT_POLICIES[remat])
    h_BSE = hidden(model, layout.tokens_MGP, layout.positions_MGP, layout.lengths_MG,
                   tokens_BS, positions_BS, seg_BS, layout.group_B)
    w_EV = model.head_weight(h_BSE.dtype)
    logp_BS, ent_BS = logprobs_from_hidden(w_EV, h_BSE, tokens_BS, seg_BS, chunk=chunk,
                                           keep_probs_mb=keep_probs_mb, entropy_grad=entropy_grad,
                                           softcap=model.cfg.final_logit_softcap)
    read_BT = layout.inverse_BT >= 0
    logp_BT = jnp.where(read_BT, _take(logp_BS, layout.inverse_BT), 0.0)
    ent_BT = jnp.where(read_BT, _take(ent_BS, layout.inverse_BT), 0.0)
    return logp_BT, ent_BT


def _logprobs(params, batch: Batch, prefix=None, *, graphdef, chunk: int, replay: bool):
    model = nnx.merge(graphdef, params)
    if prefix is not None:  # shared prompts (`jaxrl.train.prefix`)
        return shared_logprobs(model, batch, prefix.whole(), chunk=chunk)[0]
    logp_BT, _ = model_logprobs(model, batch, chunk=chunk, replay=replay)
    return logp_BT


@functools.cache
def make_logprobs_fn(graphdef, *, chunk: int, out_sharding=None, replay: bool = False):
    """Jitted `logprobs(params, batch, prefix=None) -> logp_BT` (f32, aligned as above) on the
    params' mesh; `prefix`: the batch's shared-prompt layout (`jaxrl.train.prefix`).

    Used for the proximal policy (current params before an update; `replay`: with the
    generator's routing, as the policy's forward) and the reference policy (its own routing).
    One jitted function per (graphdef, chunk, replay, out_sharding), shared by every Trainer:
    a trainer rebuilt on another mesh (a live move) reuses what was compiled for it ahead
    (`jaxrl.train.trainer.precompile_step`)."""
    key = (graphdef, chunk, replay, out_sharding)
    if key not in _LOGPROBS_JITTED:
        fn = functools.partial(_logprobs, graphdef=graphdef, chunk=chunk, replay=replay)
        _LOGPROBS_JITTED[key] = jax.jit(fn, out_shardings=out_sharding)
    return _LOGPROBS_JITTED[key]


_LOGPROBS_JITTED: dict = {}


def full_logprobs_reference(model, batch: Batch):
    """Unchunked reference (materialises [B, T, V]); for tests only."""
    logits_BTV = model(batch.tokens, batch.positions, batch.segment_ids).astype(jnp.float32)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    lp_BT = jnp.take_along_axis(logp_BTV[:, :-1], batch.tokens[:, 1:, None], axis=-1)[..., 0]
    seg = batch.segment_ids
    ok_BT = (seg[:, 1:] > 0) & (seg[:, 1:] == seg[:, :-1])
    lp_BT = jnp.where(ok_BT, lp_BT, 0.0)
    return jnp.concatenate([jnp.zeros_like(lp_BT[:, :1]), lp_BT], axis=1)
