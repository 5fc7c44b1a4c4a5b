"""Shared helpers for the kernel tests: tolerances per dtype and a comparison."""

import numpy as np

# Tolerances per dtype, against the f32 jnp reference on the same (rounded) inputs. bf16: the
# kernels feed bf16 probabilities to the P @ V matmul and round the output to bf16 (eps 2^-8).
TOLERANCES = {"float32": dict(atol=2e-5, rtol=2e-5), "bfloat16": dict(atol=3e-2, rtol=3e-2)}
GRAD_TOLERANCES = {"float32": dict(atol=1e-4, rtol=1e-4), "bfloat16": dict(atol=6e-2, rtol=6e-2)}


def assert_close(actual, expected, dtype_name, tolerances=TOLERANCES):
    np.testing.assert_allclose(
        np.asarray(actual, np.float32), np.asarray(expected, np.float32), **tolerances[dtype_name]
    )
