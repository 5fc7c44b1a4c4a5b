"""The service's jitted losses of N LoRA adapters at once: the trainer's chunked log-prob pass
and the Tinker losses (`jaxrl.train.tinker`). Stateless: `Backend` passes each client's adapters
and the shared base in, and keeps what comes back."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from flax import nnx

from jaxrl.models import lora
from jaxrl.train import tinker
from jaxrl.train.logprobs import target_logprobs

LOGPROB_CHUNK = 128  # positions per lm-head chunk (as `TrainConfig.logprob_chunk`)


def _logprobs(adapters, base, tokens_BT, targets_BT, *, graphdef):
    model = nnx.merge(graphdef, lora.join(base, adapters))
    h_BTE = model.hidden(tokens_BT)
    w_EV = model.head_weight(h_BTE.dtype)
    return target_logprobs(w_EV, h_BTE, targets_BT, chunk=LOGPROB_CHUNK,
                           softcap=model.cfg.final_logit_softcap)[0]  # Gemma 2's, or None


def _loss(adapters, base, tokens_BT, targets_BT, mask_BT, inputs, cfg, *, graphdef, loss):
    logp_BT = _logprobs(adapters, base, tokens_BT, targets_BT, graphdef=graphdef)
    per_token_BT = tinker.LOSSES[loss][0](logp_BT, inputs, cfg) * mask_BT
    return jnp.sum(per_token_BT), (logp_BT, per_token_BT)


@functools.cache
def jitted_loss(graphdef, loss: str, backward: bool):
    """The loss (and gradient) of N adapters at once, `fn(adapters_N, base, tokens_NBT,
    targets_NBT, mask_NBT, inputs_N, cfg_N)` with `adapters_N` a tuple of N adapter trees:
    stacked on a leading axis and `jax.vmap`ped with the base shared (`in_axes=None`). Each
    adapter's loss sums over its own rows only, so its gradient (returned per adapter) is its
    solo gradient; the base matmuls of all N fold into one (`[N*B*T, E] @ W`) and the adapter
    matmuls become one batched matmul (`[B*T, in] @ A[n]` per adapter: the segmented multi-LoRA
    product). With N = 1 the stack is a reshape: nothing is copied."""
    fn = functools.partial(_loss, graphdef=graphdef, loss=loss)
    if backward:
        fn = jax.value_and_grad(fn, has_aux=True)
    many = jax.vmap(fn, in_axes=(0, None, 0, 0, 0, 0, 0))

    def step(adapters_N, base, *batch):
        out = many(jax.tree.map(lambda *xs: jnp.stack(xs), *adapters_N), base, *batch)
        if not backward:
            return out
        value, grads = out
        return value, [jax.tree.map(lambda g, j=j: g[j], grads) for j in range(len(adapters_N))]

    return jax.jit(step)


@functools.cache
def jit_logprobs(graphdef):
    return jax.jit(functools.partial(_logprobs, graphdef=graphdef))


accumulate = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=0)
