"""Per-layer rematerialisation that holds on every XLA backend (`ModelConfig.remat`).

`jax.checkpoint` marks its recomputation with optimization barriers so that XLA cannot merge it
with the forward pass. XLA's CPU pipeline removes those barriers before common-subexpression
elimination, so there the recomputed layer folds back into the forward one and every layer's
activations stay live until the backward pass: the compiled step keeps as much memory as without
remat (measured in docs/memory.md). `recompute_in_backward` instead gives the recomputation a
data dependence on the layer's output cotangent (`x + 0 * ct[0]`): no pass can hoist it above
that layer's backward or merge it with the forward, so at most one layer's activations are live
in the backward pass on CPU, GPU and TPU alike. The extra work is one scalar multiply-add over
the layer input. Gradients equal the plain backward pass's (tests/models/test_remat.py).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx


def _tie(x, ct):
    """`x`, made to depend on the first element of `ct` (a cotangent array) through a product
    with zero that compilers do not fold for floats (0 * inf is nan)."""
    if not jnp.issubdtype(x.dtype, jnp.floating):
        return x
    return x + (ct.reshape(-1)[0] * 0).astype(x.dtype)


def recompute_in_backward(f):
    """`f(state, x, *rest)` (x: a float array, the first output a float array like it) with its
    residuals cut to its inputs: the backward pass recomputes `f` after the first output's
    cotangent arrives. First-order reverse-mode only (what the trainer takes)."""

    @jax.custom_vjp
    def g(state, x, *rest):
        return f(state, x, *rest)

    def fwd(state, x, *rest):
        return f(state, x, *rest), (state, x, rest)

    def bwd(res, ct):
        state, x, rest = res
        first = ct[0] if isinstance(ct, tuple) else ct
        _, vjp = jax.vjp(f, state, _tie(x, first), *rest)
        return vjp(ct)

    g.defvjp(fwd, bwd)
    return g


def remat_call(module: nnx.Module, x, *rest):
    """`module(x, *rest)` with its activations recomputed in the backward pass
    (`recompute_in_backward`); the module must not change its own state when called."""
    graphdef, state = nnx.split(module)

    def f(state, x, *rest):
        return nnx.merge(graphdef, state)(x, *rest)

    return recompute_in_backward(f)(state, x, *rest)
