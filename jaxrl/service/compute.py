"""The service's jitted pure functions: LoRA losses for N adapters at once, and Tinker's Adam.

They hold no state: `Backend` (backend.py) passes each client's adapters, moments and the shared
base in, and keeps what comes back.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from jaxrl.models import lora
from jaxrl.service.losses import LOSSES


def _logprobs(adapters, base, tokens_BT, targets_BT, *, graphdef):
    model = nnx.merge(graphdef, lora.join(base, adapters))
    logits_BTV = model(tokens_BT)
    logp_BTV = jax.nn.log_softmax(logits_BTV, axis=-1)
    return jnp.take_along_axis(logp_BTV, targets_BT[..., None], axis=-1)[..., 0]


def _loss(adapters, base, tokens_BT, targets_BT, mask_BT, inputs, cfg, *, graphdef, loss):
    logp_BT = _logprobs(adapters, base, tokens_BT, targets_BT, graphdef=graphdef)
    per_token_BT = LOSSES[loss][0](logp_BT, inputs, cfg) * mask_BT
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


accumulate = jax.jit(lambda acc, g: jax.tree.map(jnp.add, acc, g), donate_argnums=0)


@functools.partial(jax.jit, donate_argnums=(0, 2, 3))
def adam_update(params, grads, mu, nu, count, hp):
    """Decoupled-weight-decay Adam (AdamW, Loshchilov & Hutter 2019) with Tinker's `AdamParams`
    (`hp`: learning_rate, beta1, beta2, eps, weight_decay, grad_clip_norm; clipping by global norm
    when > 0). `count` is the 1-based step for bias correction."""
    gnorm = optax.global_norm(grads)
    clip = hp["grad_clip_norm"]
    scale = jnp.where(clip > 0, jnp.minimum(1.0, clip / jnp.maximum(gnorm, 1e-12)), 1.0)
    b1, b2 = hp["beta1"], hp["beta2"]
    mu = jax.tree.map(lambda m, g: b1 * m + (1 - b1) * g * scale, mu, grads)
    nu = jax.tree.map(lambda v, g: b2 * v + (1 - b2) * jnp.square(g * scale), nu, grads)
    c1, c2 = 1 - b1**count, 1 - b2**count

    def step(p, m, v):
        upd = (m / c1) / (jnp.sqrt(v / c2) + hp["eps"]) + hp["weight_decay"] * p
        return p - hp["learning_rate"] * upd

    return jax.tree.map(step, params, mu, nu), mu, nu, gnorm


ADAM_DEFAULTS = dict(learning_rate=1e-4, beta1=0.9, beta2=0.95, eps=1e-12, weight_decay=0.0,
                     grad_clip_norm=0.0)


@functools.cache
def jit_logprobs(graphdef):
    return jax.jit(functools.partial(_logprobs, graphdef=graphdef))
