"""The w8a8 projection in plain jnp (the XLA form of `jaxrl.models.quant`), for tests."""

import jax.numpy as jnp


def w8a8_matmul_reference(x_MK, q_KN, scale_N):
    x = x_MK.astype(jnp.float32)
    amax = jnp.max(jnp.abs(x), axis=1, keepdims=True)
    t = jnp.where(amax > 0, amax / 127, 1.0).astype(jnp.float32)
    p = jnp.clip(jnp.round(x / t), -127, 127).astype(jnp.int8)
    acc = jnp.dot(p, q_KN, preferred_element_type=jnp.int32).astype(jnp.float32)
    return (acc * t * scale_N[None, :]).astype(x_MK.dtype)
