"""Floating-point dtypes: one spelling inside jaxrl, any spelling a JAX or numpy user writes.

`canonical_dtype` turns what a JAX or numpy user writes into the name configs store:

    "bfloat16", jnp.bfloat16, jnp.dtype("bfloat16"), ml_dtypes.bfloat16  -> "bfloat16"
    "float32", np.float32, jnp.float32, np.dtype("float32"), "f4"        -> "float32"
    "float16", np.float16, jnp.float16, "half"                           -> "float16"

Anything else (float64, integer types, unknown names) fails with the value and the valid choices.
Configs call it, so importing this module imports nothing (no JAX, and numpy only for a value that
is not already a valid name). `jnp.bfloat16` and friends are classes with a numpy `.dtype`, so
`np.dtype(...)` reads them without importing JAX; ml_dtypes registers "bfloat16" with numpy.
"""

from __future__ import annotations

from typing import Any

DTYPE_NAMES = ("float32", "bfloat16", "float16")


def canonical_dtype(value: Any, key: str = "dtype", error: type[Exception] = ValueError) -> str:
    """The name ("float32" | "bfloat16" | "float16") of a dtype given as a name, a numpy or
    ml_dtypes dtype or scalar type, or a JAX one (`jnp.bfloat16`, `jnp.dtype("float32")`).

    Raises `error` (a config passes its own error type) naming `key`, the value and the choices.
    """
    if isinstance(value, str) and value in DTYPE_NAMES:
        return value
    import ml_dtypes  # noqa: F401  (registers bfloat16 with numpy: np.dtype("bfloat16") works)
    import numpy as np

    try:
        name = np.dtype(value).name if value is not None else None
    except (TypeError, ValueError):
        name = None
    if name not in DTYPE_NAMES:
        raise error(f"{key}: invalid dtype {value!r}; valid choices: {list(DTYPE_NAMES)} (as a "
                    "name, or a numpy / JAX dtype or scalar type such as jnp.bfloat16)")
    return name
