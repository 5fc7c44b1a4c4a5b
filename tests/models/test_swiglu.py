"""The hand-written SwiGLU backward equals autodiff of the plain expression."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.swiglu import swiglu


def _plain(x, wg, wu, wd):
    return (jax.nn.silu(x @ wg) * (x @ wu)) @ wd


def _operands(dtype, shape=(3, 5, 16), f=24):
    k = jax.random.split(jax.random.key(0), 5)
    e = shape[-1]
    x = jax.random.normal(k[0], shape)
    wg, wu = (jax.random.normal(k[i], (e, f)) * 0.3 for i in (1, 2))
    wd = jax.random.normal(k[3], (f, e)) * 0.3
    cot = jax.random.normal(k[4], shape)
    return tuple(a.astype(dtype) for a in (x, wg, wu, wd)), cot.astype(dtype)


@pytest.mark.parametrize("shape", [(3, 5, 16), (7, 16)], ids=["BTE", "NE"])
def test_value_and_gradients_equal_autodiff_f32(shape):
    args, cot = _operands(jnp.float32, shape)
    np.testing.assert_allclose(swiglu(*args), _plain(*args), rtol=1e-6, atol=1e-6)
    _, vjp_got = jax.vjp(swiglu, *args)
    _, vjp_want = jax.vjp(_plain, *args)
    for got, want, name in zip(vjp_got(cot), vjp_want(cot), ["x", "w_gate", "w_up", "w_down"],
                                   strict=True):
        assert got.shape == want.shape and got.dtype == want.dtype, name
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5, err_msg=name)


def test_bf16_gradients_close_to_f32_and_keep_dtype():
    args, cot = _operands(jnp.bfloat16)
    _, vjp16 = jax.vjp(swiglu, *args)
    _, vjp32 = jax.vjp(_plain, *(a.astype(jnp.float32) for a in args))
    for got, want in zip(vjp16(cot), vjp32(cot.astype(jnp.float32)), strict=True):
        assert got.dtype == jnp.bfloat16
        # bf16 keeps ~3 significant digits; relative to the gradient's scale
        scale = float(jnp.max(jnp.abs(want)))
        assert float(jnp.max(jnp.abs(got.astype(jnp.float32) - want))) < 3e-2 * scale


def test_gradient_of_a_loss_under_jit():
    # the MLP as the model uses it: inside jit, gradient of a scalar loss
    args, _ = _operands(jnp.float32)
    loss = lambda f: (lambda *a: jnp.sum(jnp.tanh(f(*a))))
    got = jax.jit(jax.grad(loss(swiglu), argnums=(0, 1, 2, 3)))(*args)
    want = jax.grad(loss(_plain), argnums=(0, 1, 2, 3))(*args)
    for g, w in zip(got, want, strict=True):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-5)
