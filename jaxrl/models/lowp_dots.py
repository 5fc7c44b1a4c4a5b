"""bf16 / f16 dots with f32 results, for the generator's decode on XLA:CPU.

XLA's CPU backend (jax 0.10.2) compiles a bf16 x bf16 -> bf16 dot as a convert of both operands
to f32, an f32 dot and a convert of the result back: every decode step widens every weight
matrix (2 bytes read, 4 written, 4 read again by the dot). The same dot asked for an f32 result
(`preferred_element_type=float32`) is one library call (YNNPACK) on the bf16 operands, summing
in f32; rounding its result to bf16 is what the widened dot did, so the numbers are the same up
to the order of the sums. docs/design.md ("Lessons from measuring") has the op counts and times.

XLA:CPU also widens a scatter into a bf16 array, the KV cache's per-row writes: a decode step's
one-entry write is a select over the cache instead (jaxrl/models/kv_cache.py), and longer
writes scatter the cache's bits (`write_as_bits`).

The wide form is used only inside `wide_results(True)`, which `JaxEngine` sets while tracing its
steps on CPU devices; elsewhere (GPU, TPU, the trainer) `einsum` and `matmul` are the plain
`jnp` calls, so those lowerings are unchanged (tests/test_lowp_dots.py lowers both).
"""

from __future__ import annotations

import contextlib
import contextvars

import jax
import jax.numpy as jnp

_WIDE = contextvars.ContextVar("jaxrl_wide_lowp_dots", default=False)
LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@contextlib.contextmanager
def wide_results(enabled: bool = True):
    """Within: low-precision dots traced by `einsum` / `matmul` ask for f32 results."""
    token = _WIDE.set(bool(enabled))
    try:
        yield
    finally:
        _WIDE.reset(token)


def _wide(x, w) -> bool:
    return _WIDE.get() and x.dtype == w.dtype and jnp.dtype(x.dtype) in LOW_PRECISION


def active() -> bool:
    """Whether this trace is inside `wide_results(True)` (an engine on CPU devices)."""
    return _WIDE.get()


def write_as_bits(write, cache, new, *rest):
    """`write(cache, new, *rest)`, a scatter into a cache; inside `wide_results`, on a 2-byte
    float cache, done on its bits (uint16): XLA:CPU widens a bf16 scatter's whole operand to
    f32 and rounds it back, which for the KV cache is every layer's whole cache converted twice
    per write. XLA:CPU copies for a bitcast-convert too, so this is two plain copies of the
    cache; a one-entry write is cheaper as a select (jaxrl/models/kv_cache.py)."""
    if not (_WIDE.get() and jnp.dtype(cache.dtype) in LOW_PRECISION):
        return write(cache, new, *rest)
    bits = lambda a: jax.lax.bitcast_convert_type(a.astype(cache.dtype), jnp.uint16)
    return jax.lax.bitcast_convert_type(write(bits(cache), bits(new), *rest), cache.dtype)


def einsum(spec: str, x, w):
    """`jnp.einsum(spec, x, w)`; inside `wide_results`, with an f32 result rounded back."""
    if _wide(x, w):
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum(spec, x, w)


def matmul(x, w):
    """`x @ w`; inside `wide_results`, with an f32 result rounded back."""
    if _wide(x, w):
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x @ w


def take_rows(table, idx):
    """`table[idx]` (an embedding lookup); inside `wide_results`, on a 2-byte float table,
    gathered on its bits: XLA:CPU widens a bf16 gather's whole table to f32, and since the table
    is loop-invariant that convert is hoisted out of the decode loop and paid once per chunk call
    (a 32000 x 512 table: ~26 ms, against ~10 ms for the bits view's copy)."""
    if not (_WIDE.get() and jnp.dtype(table.dtype) in LOW_PRECISION):
        return table[idx]
    rows = jax.lax.bitcast_convert_type(table, jnp.uint16)[idx]
    return jax.lax.bitcast_convert_type(rows, table.dtype)


def table_logits(x_BTE, table_VE):
    """f32 logits `x @ table.T` for a `[V, E]` table (a tied lm head), for `wide_results`: computed
    as `table @ x.T` and transposed back. XLA:CPU's library dot wants its right operand `[E, V]` in
    memory, so `x @ table.T` copies the whole table once per chunk call (hoisted out of the decode
    loop); with the table on the left the dot reads it in place, and for a decode step's few rows
    that form is also the faster one (docs/design.md has the times)."""
    w = table_VE.astype(x_BTE.dtype)
    logits_VBT = jnp.einsum("ve,bte->vbt", w, x_BTE, preferred_element_type=jnp.float32)
    return jnp.transpose(logits_VBT, (1, 2, 0))
