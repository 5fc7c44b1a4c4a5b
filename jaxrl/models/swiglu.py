"""The SwiGLU MLP, `(silu(x Wg) * (x Wu)) Wd`, with a hand-written backward pass.

Autodiff of the same expression gives the same numbers, but XLA's CPU backend schedules it badly:
the weight gradients contract over the token axis, and for autodiff's graph the layout pass
materialises each [T, F] activation gradient transposed, fused into the silu derivative, before
the dot. Written out by hand, the backward keeps row-major [T, F] operands throughout. Measured on
one 4 x 512-token micro-batch of the 40M benchmark model's MLP (E 512, F 1408, f32, 2 CPU
cores): forward + backward 0.205 s with autodiff vs 0.155 s with this VJP (torch: 0.161 s).

Residuals are the same as autodiff's essentials: the input and the two pre-activations. The
elementwise part of the backward runs in f32 and is cast back to the activation dtype before the
dots, so bf16 models keep bf16 dots.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from jaxrl.models import lowp_dots


@jax.custom_vjp
def swiglu(x_BTE, w_gate_EF, w_up_EF, w_down_FE):
    """`(silu(x @ w_gate) * (x @ w_up)) @ w_down`; all operands in one dtype."""
    return _forward(x_BTE, w_gate_EF, w_up_EF, w_down_FE)[0]


def _forward(x_BTE, w_gate_EF, w_up_EF, w_down_FE):
    gate_BTF = lowp_dots.matmul(x_BTE, w_gate_EF)
    up_BTF = lowp_dots.matmul(x_BTE, w_up_EF)
    out_BTE = lowp_dots.matmul(lowp_dots.gated(jax.nn.silu, gate_BTF, up_BTF), w_down_FE)
    return out_BTE, (x_BTE, w_gate_EF, w_up_EF, w_down_FE, gate_BTF, up_BTF)


def _backward(residuals, d_out_BTE):
    x_BTE, w_gate_EF, w_up_EF, w_down_FE, gate_BTF, up_BTF = residuals
    dt = x_BTE.dtype
    e, f = w_gate_EF.shape
    x_NE = x_BTE.reshape(-1, e)  # N = all tokens: row-major operands for every dot
    dy_NE = d_out_BTE.reshape(-1, e)
    gate_NF = gate_BTF.reshape(-1, f).astype(jnp.float32)
    up_NF = up_BTF.reshape(-1, f).astype(jnp.float32)
    sig_NF = jax.nn.sigmoid(gate_NF)
    act_NF = gate_NF * sig_NF  # silu(gate)
    h_NF = (act_NF * up_NF).astype(dt)
    dh_NF = (dy_NE @ w_down_FE.T).astype(jnp.float32)
    # silu'(g) = sig(g) (1 + g (1 - sig(g)))
    d_gate_NF = (dh_NF * up_NF * sig_NF * (1.0 + gate_NF * (1.0 - sig_NF))).astype(dt)
    d_up_NF = (dh_NF * act_NF).astype(dt)
    dw_down_FE = h_NF.T @ dy_NE
    dw_gate_EF = x_NE.T @ d_gate_NF
    dw_up_EF = x_NE.T @ d_up_NF
    dx_NE = d_gate_NF @ w_gate_EF.T + d_up_NF @ w_up_EF.T
    return dx_NE.reshape(x_BTE.shape).astype(dt), dw_gate_EF, dw_up_EF, dw_down_FE


swiglu.defvjp(_forward, _backward)
