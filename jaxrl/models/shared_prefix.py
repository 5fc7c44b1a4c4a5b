"""The forward pass of rows that share a prompt: the prompt runs once per group, not once per row.

A GRPO batch holds n samples of each prompt, and under causal attention a prompt's hidden states
do not depend on what follows it, so the n rows of a group compute the same prompt activations n
times. Here each distinct prefix runs once (`[G, P]`), and each row runs only its suffix (`[B, S]`:
the last prefix token, then its completion), whose queries attend to its group's prefix keys and
values, then causally to its own suffix. The result equals the plain forward's over the whole
rows; the gradient reaching a prefix is the sum over its group's rows (the gather's transpose).
The trainer lays batches out for it in `jaxrl.train.prefix`.

Dense models only (a mixture of experts takes the plain forward, whose routing statistics and
replay are per row).
"""

from __future__ import annotations

import jax.numpy as jnp
from flax import nnx

from jaxrl.models.attention import attention, masked_attention, query_blocks, window_mask
from jaxrl.models.remat import recompute_in_backward
from jaxrl.models.transformer import Transformer, layer_rope, rope_tables


def prefix_attention(q_BSHD, k_BSKD, v_BSKD, k_GPKD, v_GPKD, segment_ids_BS, prefix_mask_GP,
                     group_B, *, positions_BS=None, prefix_positions_GP=None,
                     window: int | None = None, softcap: float | None = None,
                     scale: float | None = None):
    """Row b's suffix queries attend to its group's valid prefix keys (`prefix_mask_GP`, group
    `group_B[b]`), then causally to its own suffix keys within its segment (segment 0: padding,
    which attends to padding only). Exact softmax per query block, as in causal attention.

    With a sliding `window` (`jaxrl.models.attention`) a query at position p sees only keys at
    positions > p - window: `positions_BS` and `prefix_positions_GP` place them."""
    scale = q_BSHD.shape[-1] ** -0.5 if scale is None else scale
    kp_BPKD, vp_BPKD = k_GPKD[group_B], v_GPKD[group_B]
    seg_BS = segment_ids_BS
    prefix_BP = prefix_mask_GP[group_B]
    if window is not None:
        if positions_BS is None or prefix_positions_GP is None:
            raise ValueError("prefix_attention: a window needs positions_BS and "
                             "prefix_positions_GP")
        pp_BP = prefix_positions_GP[group_B]
    outs = []
    for i, e in query_blocks(q_BSHD.shape[1]):
        seen_BTP = prefix_BP[:, None, :] & (seg_BS[:, i:e, None] > 0)
        causal_TS = jnp.arange(i, e)[:, None] >= jnp.arange(e)[None, :]
        own_BTS = causal_TS[None] & (seg_BS[:, i:e, None] == seg_BS[:, None, :e])
        if window is not None:
            q_BT1 = positions_BS[:, i:e, None]
            seen_BTP = seen_BTP & window_mask(q_BT1, pp_BP[:, None, :], window)
            own_BTS = own_BTS & window_mask(q_BT1, positions_BS[:, None, :e], window)
        keys = jnp.concatenate([kp_BPKD, k_BSKD[:, :e]], axis=1)
        values = jnp.concatenate([vp_BPKD, v_BSKD[:, :e]], axis=1)
        mask = jnp.concatenate([seen_BTP, own_BTS], axis=-1)
        outs.append(masked_attention(q_BSHD[:, i:e], keys, values, mask, scale, softcap))
    return outs[0] if len(outs) == 1 else jnp.concatenate(outs, axis=1)


def _layer(layer, xp_GPE, xs_BSE, rope_p, rope_s, seg_p_GP, seg_s_BS, prefix_mask_GP, group_B,
           pos_p_GP, pos_s_BS):
    """One decoder layer over the prefixes and the suffixes: `(xp, xs)`."""
    attn = layer.attn
    hp, hs = layer.attn_in(xp_GPE), layer.attn_in(xs_BSE)
    qp, kp, vp = attn._qkv(hp, layer_rope(rope_p, attn.window))
    qs, ks, vs = attn._qkv(hs, layer_rope(rope_s, attn.window))
    options = dict(attn.options)
    out_p = attention(qp, kp, vp, segment_ids_BT=seg_p_GP, impl=attn.cfg.attention_impl,
                      **options)
    out_s = prefix_attention(qs, ks, vs, kp, vp, seg_s_BS, prefix_mask_GP, group_B,
                             positions_BS=pos_s_BS, prefix_positions_GP=pos_p_GP, **options)
    xp_GPE = xp_GPE + layer.attn_out(attn._out(out_p, hp.dtype))
    xs_BSE = xs_BSE + layer.attn_out(attn._out(out_s, hs.dtype))
    return layer._mlp(xp_GPE, None)[0], layer._mlp(xs_BSE, None)[0]


def shared_prefix_hidden(model: Transformer, prefix_tokens_GP, prefix_positions_GP,
                         prefix_lengths_G, tokens_BS, positions_BS, segment_ids_BS, group_B):
    """Final-normed hidden states `[B, S, E]` of the suffixes (see the module docstring).

    Prefix g holds `prefix_lengths_G[g]` real tokens (the rest padding; length 0: an empty
    prefix); row b continues prefix `group_B[b]` with its suffix, whose positions carry on from
    the prefix's. With `ModelConfig.remat`, each layer is recomputed in the backward pass."""
    if any(layer.sparse for layer in model.layers):
        raise ValueError("the shared-prefix forward takes dense models only (a mixture of "
                         "experts routes per row); use Transformer.hidden")
    cfg = model.cfg
    p = prefix_tokens_GP.shape[1]
    prefix_mask_GP = jnp.arange(p)[None, :] < prefix_lengths_G[:, None]
    seg_p_GP = prefix_mask_GP.astype(jnp.int32)
    rope_p = rope_tables(cfg, prefix_positions_GP)
    rope_s = rope_tables(cfg, positions_BS)
    xp, xs = model._embed(prefix_tokens_GP), model._embed(tokens_BS)
    fixed = (rope_p, rope_s, seg_p_GP, segment_ids_BS, prefix_mask_GP, group_B,
             prefix_positions_GP, positions_BS)
    for layer in model.layers:
        if cfg.remat:
            xp, xs = _remat_layer(layer, xp, xs, *fixed)
        else:
            xp, xs = _layer(layer, xp, xs, *fixed)
    return model.final_norm(xs)


def _remat_layer(layer, xp, xs, *fixed):
    """`_layer` with its activations recomputed in the backward pass (`recompute_in_backward`:
    the pair travels as one array so the recomputation waits for the suffix's cotangent)."""
    graphdef, state = nnx.split(layer)
    g, p, e = xp.shape

    def f(state, x_flat, *fixed):
        xp_, xs_ = x_flat[: g * p].reshape(g, p, e), x_flat[g * p:].reshape(xs.shape)
        op, os_ = _layer(nnx.merge(graphdef, state), xp_, xs_, *fixed)
        return jnp.concatenate([op.reshape(-1, e), os_.reshape(-1, e)])

    flat = jnp.concatenate([xp.reshape(-1, e), xs.reshape(-1, e)])
    out = recompute_in_backward(f)(state, flat, *fixed)
    return out[: g * p].reshape(xp.shape), out[g * p:].reshape(xs.shape)
