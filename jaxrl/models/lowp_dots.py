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
import numpy as np
from flax import nnx

_WIDE = contextvars.ContextVar("jaxrl_wide_lowp_dots", default=False)
_KERNELS = contextvars.ContextVar("jaxrl_cpu_kernels", default=False)
LOW_PRECISION = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))


@contextlib.contextmanager
def wide_results(enabled: bool = True, *, kernels: bool = False):
    """Within: low-precision dots traced by `einsum` / `matmul` ask for f32 results; with
    `kernels`, the step may call jaxrl's CPU custom calls (`cpu_kernels()`)."""
    tokens = _WIDE.set(bool(enabled)), _KERNELS.set(bool(enabled and kernels))
    try:
        yield
    finally:
        _WIDE.reset(tokens[0])
        _KERNELS.reset(tokens[1])


def _wide(x, w) -> bool:
    return _WIDE.get() and x.dtype == w.dtype and jnp.dtype(x.dtype) in LOW_PRECISION


def active() -> bool:
    """Whether this trace is inside `wide_results(True)` (an engine on CPU devices)."""
    return _WIDE.get()


def cpu_kernels() -> bool:
    """Whether this trace may call the CPU custom calls (`jaxrl_kernels.cpu_*`): an engine on
    one CPU device. They have no sharding rule, so over several devices XLA would gather their
    operands (a whole KV cache a layer) and run each call whole on every device."""
    return _KERNELS.get()


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
    """`jnp.einsum(spec, x, w)`; inside `wide_results`, with an f32 result rounded back, and a
    contraction over several axes (`bthd,hde->bte`) as one 2-D dot (`_flat_dot`)."""
    if _WIDE.get() and (flat := _flat_dot(spec, x, w)) is not None:
        return flat
    if _wide(x, w):
        return jnp.einsum(spec, x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return jnp.einsum(spec, x, w)


def _flat_dot(spec: str, x, w):
    """`x [rows..., contracted...] @ w [contracted..., cols...]` with several contracted axes, in
    the same order on both sides, as `[rows, K] @ [K, cols]` (None for any other spec).
    `jnp.einsum` lists the contracted axes in its own order (`d` before `h`), and XLA:CPU then
    transposes both operands to it at every call: o's whole weight and its input, every layer
    of every decode step."""
    (x_axes, w_axes), out = spec.split("->")[0].split(","), spec.split("->")[1]
    n = len([a for a in x_axes if a in w_axes and a not in out])
    rows = x_axes[:len(x_axes) - n]
    if n < 2 or w_axes[:n] != x_axes[len(rows):] or out != rows + w_axes[n:]:
        return None
    k = int(np.prod(w.shape[:n]))
    out2 = einsum("mk,kn->mn", x.reshape(-1, k), w.reshape(k, -1))
    return out2.reshape(*x.shape[:len(rows)], *w.shape[n:])


def matmul(x, w):
    """`x @ w`; inside `wide_results`, with an f32 result rounded back."""
    if _wide(x, w):
        return jnp.matmul(x, w, preferred_element_type=jnp.float32).astype(x.dtype)
    return x @ w


def gated(act, gate, up):
    """`act(gate) * up` (a GLU's activation); inside `wide_results`, on 2-byte floats, computed
    in f32 and rounded once, as a fused SiLU-and-multiply kernel does: XLA:CPU otherwise rounds
    each step of the activation to bf16 (5 round trips a SiLU), ~3.3 ms of a 16-row prefill
    layer's ~19 (docs/design.md)."""
    if _WIDE.get() and jnp.dtype(gate.dtype) in LOW_PRECISION:
        wide = act(gate.astype(jnp.float32)) * up.astype(jnp.float32)
        return wide.astype(gate.dtype)
    return act(gate) * up


def take_rows(table, idx):
    """`table[idx]` (an embedding lookup); inside `wide_results`, on a 2-byte float table,
    gathered on its bits: XLA:CPU widens a bf16 gather's whole table to f32, and since the table
    is loop-invariant that convert is hoisted out of the decode loop and paid once per chunk call
    (a 32000 x 512 table: ~26 ms, against ~10 ms for the bits view's copy)."""
    if not (_WIDE.get() and jnp.dtype(table.dtype) in LOW_PRECISION):
        return table[idx]
    rows = jax.lax.bitcast_convert_type(table, jnp.uint16)[idx]
    return jax.lax.bitcast_convert_type(rows, table.dtype)


def table_logits(x_BTE, table_VE, *, vocab_major: bool = False):
    """f32 logits `x @ table.T` for a `[V, E]` table (a tied lm head), for `wide_results`: computed
    as `table @ x.T` and transposed back. XLA:CPU's library dot wants its right operand `[E, V]` in
    memory, so `x @ table.T` copies the whole table once per chunk call (hoisted out of the decode
    loop); with the table on the left the dot reads it in place, and for a decode step's few rows
    that form is also the faster one (docs/design.md has the times). `vocab_major`: returned as
    the dot makes them, `[V, B, T]`, for a caller that reads them so (the decode step's sampler)."""
    w = table_VE.astype(x_BTE.dtype)
    logits_VBT = jnp.einsum("ve,bte->vbt", w, x_BTE, preferred_element_type=jnp.float32)
    return logits_VBT if vocab_major else jnp.transpose(logits_VBT, (1, 2, 0))


def out_in_spec(spec: str) -> tuple[str, tuple[int, ...]]:
    """`spec` ("x,w->out") with the weight's axes reordered output axes first, contracted axes
    last (PyTorch's [out, in]), and the permutation of the weight's axes that gives that order."""
    inputs, out = spec.split("->")
    x, w = inputs.split(",")
    contracted = [a for a in w if a in x and a not in out]
    order = [a for a in w if a not in contracted] + contracted
    return f"{x},{''.join(order)}->{out}", tuple(w.index(a) for a in order)


def hold_out_in(module, specs: dict[str, str]) -> None:
    """Replace each named weight of `module` (contracted by `specs[name]`) by its transpose in
    `out_in_spec` order, with its logical axes permuted alike, and mark the module (`out_in`).

    At a decode step's few rows XLA:CPU's library dot on bf16 runs faster reading a weight laid
    out [out, in] than [in, out]: a dense MLP layer 1.2-1.3x at 32 rows, 1.05x at 128, the same
    at 2048 (prefill); in f32 it is slower (docs/design.md). XLA folds a transpose inside the
    step into the dot, which then wants the [in, out] layout back, so the weights are held
    transposed instead (`JaxEngine` does this for its own copy on CPU)."""
    for name, spec in specs.items():
        param = getattr(module, name)
        perm = out_in_spec(spec)[1]
        axes = param.get_metadata()["logical_axes"]
        setattr(module, name, nnx.Param(jnp.transpose(param[...], perm),
                                        logical_axes=tuple(axes[i] for i in perm)))
    module.out_in = True


def einsum_out_in(spec: str, x, w):
    """`einsum(spec, x, w)` for a weight held in `out_in_spec(spec)` order, as one 2-D dot
    `[rows, in] x [out, in]`: with more than one row axis (`bte`) XLA:CPU canonicalizes the
    dot to a `[in, out]` right operand, copying the weight per call."""
    x_axes, w_axes, out = *spec.split("->")[0].split(","), spec.split("->")[1]
    contracted = "".join(a for a in w_axes if a in x_axes and a not in out)
    rows, cols = x_axes[: len(x_axes) - len(contracted)], w_axes[: len(w_axes) - len(contracted)]
    if x_axes != rows + contracted or out != rows + cols:  # not of that form: the plain einsum
        return einsum(f"{x_axes},{w_axes}->{out}", x, w)
    n_rows = len(rows)
    x2 = x.reshape(-1, int(np.prod(x.shape[n_rows:])))
    w2 = w.reshape(int(np.prod(w.shape[: len(cols)])), -1)
    out2 = einsum("mk,nk->mn", x2, w2)
    return out2.reshape(*x.shape[:n_rows], *w.shape[: len(cols)])
