"""flash_attention (both bodies, interpret mode) against the jnp reference: forward and gradient."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.experimental.pallas import tpu as pltpu
from kernel_testing import (
    GRAD_TOLERANCES,
    TOLERANCES,
    assert_close,
    attention_f64,
    attention_grad_f64,
    pallas_grids,
    sliding_window_visible,
)

import jaxrl_kernels
from jaxrl_kernels.flash_attention import BlockSizes, flash_attention_reference
from jaxrl_kernels.flash_attention.ops import _block_bounds, _kv_steps, _q_steps

SMALL = BlockSizes(block_q=32, block_k=16, bwd_chunk=16)


def _inputs(B, T, S, Hq, Hkv, D, dtype, seed=0):
    kq, kk, kv = jax.random.split(jax.random.key(seed), 3)
    q = jax.random.normal(kq, (B, T, Hq, D), jnp.float32).astype(dtype)
    k = jax.random.normal(kk, (B, S, Hkv, D), jnp.float32).astype(dtype)
    v = jax.random.normal(kv, (B, S, Hkv, D), jnp.float32).astype(dtype)
    return q, k, v


def _packed_segments(B, T, seed=0):
    """Several packed documents per row, then padding (its own id, 0) at the end of row 0."""
    rng = np.random.default_rng(seed)
    rows = []
    for b in range(B):
        cuts = np.sort(rng.choice(np.arange(1, T - 4), size=2, replace=False))
        row = np.searchsorted(cuts, np.arange(T), side="right") + 1
        if b == 0:
            row[T - 5 :] = 0
        rows.append(row)
    return jnp.asarray(np.stack(rows), jnp.int32)


# (G = Hq // Hkv, D, T, S, dtype, causal, segments, Hkv): GQA ratios 1/2/4/8, head dims 64/128,
# lengths that are not multiples of the blocks, padding + several segments, cross lengths,
# and a ratio that is not a power of two.
CASES = [
    (1, 64, 40, 40, "float32", True, False, 2),
    (2, 128, 33, 33, "bfloat16", True, True, 1),
    (4, 64, 48, 48, "float32", False, True, 1),
    (8, 64, 21, 21, "bfloat16", True, True, 1),
    (4, 128, 20, 37, "float32", False, False, 1),
    (3, 64, 11, 11, "float32", True, True, 1),  # G not a power of two (GPU pads it)
]


@pytest.mark.parametrize("G,D,T,S,dtype,causal,segments,Hkv", CASES)
def test_forward_matches_reference(interpret, G, D, T, S, dtype, causal, segments, Hkv):
    B = 2
    q, k, v = _inputs(B, T, S, G * Hkv, Hkv, D, jnp.dtype(dtype))
    seg = _packed_segments(B, T) if segments else None
    out = jaxrl_kernels.flash_attention(
        q, k, v, causal=causal, segment_ids=seg, block_sizes=SMALL, interpret=interpret
    )
    ref = flash_attention_reference(q, k, v, causal=causal, segment_ids=seg)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert_close(out, ref, dtype, TOLERANCES)


@pytest.mark.parametrize(
    "G,D,dtype,segments",
    [(2, 64, "float32", True), (4, 128, "bfloat16", False), (3, 64, "float32", True)],
)
def test_gradient_matches_reference(interpret, G, D, dtype, segments):
    B, T, Hkv = 2, 24, 1
    q, k, v = _inputs(B, T, T, G * Hkv, Hkv, D, jnp.dtype(dtype), seed=1)
    w = jax.random.normal(jax.random.key(2), q.shape, jnp.float32)
    seg = _packed_segments(B, T, seed=1) if segments else None

    def loss(fn):
        return lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) * w)

    kernel = lambda q, k, v: jaxrl_kernels.flash_attention(
        q, k, v, segment_ids=seg, block_sizes=SMALL, interpret=interpret
    )
    reference = lambda q, k, v: flash_attention_reference(q, k, v, segment_ids=seg)
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        assert g.dtype == q.dtype
        assert_close(g, r, dtype, GRAD_TOLERANCES)


def test_block_bounds_skip_causal_and_segments():
    # T = 64, G = 1, blocks of 16: causal q block i needs kv blocks [0, i]; only block i is masked.
    b = np.asarray(_block_bounds(1, 64, 64, 1, 16, 16, True, None, None))[0]
    np.testing.assert_array_equal(b[:, 2], [1, 2, 3, 4])  # hi
    np.testing.assert_array_equal(b[:, 1], [0, 1, 2, 3])  # mid: [lo, mid) unmasked
    # Two packed documents of 32 tokens: the second document's q blocks never read the first's kv.
    seg = jnp.asarray([[1] * 32 + [2] * 32], jnp.int32)
    b = np.asarray(_block_bounds(1, 64, 64, 1, 16, 16, True, seg, seg))[0]
    np.testing.assert_array_equal(b[:, 0], [0, 0, 2, 2])  # lo
    np.testing.assert_array_equal(b[:, 2], [1, 2, 3, 4])  # hi
    # GQA folding (G = 4): q block of 16 folded rows = 4 tokens.
    b = np.asarray(_block_bounds(1, 64 * 4, 64, 4, 16, 16, True, None, None))[0]
    assert b[0, 2] == 1 and b[4, 2] == 2 and b[-1, 2] == 4


def test_rejects_bad_shapes():
    q, k, v = _inputs(1, 8, 8, 3, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match="multiple"):
        jaxrl_kernels.flash_attention(q, k, v, interpret=True)


def test_cpu_default_interprets_the_gpu_body():
    """CPU has no compiled Pallas: interpret=False runs the GPU body interpreted (impl="pallas")."""
    if jax.default_backend() != "cpu":
        pytest.skip("CPU-only check")
    q, k, v = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
    out = jaxrl_kernels.flash_attention(q, k, v)
    assert_close(out, flash_attention_reference(q, k, v), "float32", TOLERANCES)


@pytest.mark.parametrize("window,softcap", [(None, None), (5, None), (5, 1.5)])
def test_xla_backward_fallback_matches_reference(window, softcap):
    """BlockSizes(pallas_backward=False): the chunked XLA backward (fallback) is exact too."""
    q, k, v = _inputs(1, 20, 20, 4, 2, 32, jnp.float32, seed=4)
    seg = _packed_segments(1, 20, seed=4)
    bs = BlockSizes(block_q=16, block_k=16, pallas_backward=False, bwd_chunk=8)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) ** 2)
    kernel = functools.partial(
        jaxrl_kernels.flash_attention,
        segment_ids=seg,
        block_sizes=bs,
        window=window,
        softcap=softcap,
    )
    got = jax.grad(
        loss(kernel),
        argnums=(0, 1, 2),
    )(q, k, v)
    reference = functools.partial(
        flash_attention_reference, segment_ids=seg, window=window, softcap=softcap
    )
    want = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for g, r in zip(got, want, strict=True):
        assert_close(g, r, "float32", GRAD_TOLERANCES)


# Sliding windows and soft caps. (G, Hkv, T, window, segments, softcap): T not a multiple of the
# blocks (q block 32 folded rows, kv block 16), windows not multiples of them, GQA (G = 3 not a
# power of two), packed segments with padding; window = 1 (each query sees only itself) has its
# own test. Soft caps (Gemma 2's scores -> cap * tanh(scores / cap)) with and without a window.
WINDOW_CASES = [
    (2, 2, 45, 7, True, None),
    (3, 1, 37, 20, False, None),
    (4, 1, 50, 17, True, None),
    (1, 2, 100, 60, False, None),  # a q block with masked, unmasked, then masked kv blocks
    (2, 2, 45, 7, True, 1.5),  # Gemma 2's sliding layers: a window and a cap
    (3, 1, 37, None, True, 2.0),  # Gemma 2's global layers: a cap alone
    (1, 2, 100, 60, False, 1.0),
]


@pytest.mark.parametrize("G,Hkv,T,window,segments,softcap", WINDOW_CASES)
def test_window_forward_matches_float64(interpret, G, Hkv, T, window, segments, softcap):
    B = 2
    q, k, v = _inputs(B, T, T, G * Hkv, Hkv, 32, jnp.float32, seed=5)
    seg = _packed_segments(B, T, seed=5) if segments else None
    out = jaxrl_kernels.flash_attention(
        q,
        k,
        v,
        segment_ids=seg,
        window=window,
        softcap=softcap,
        block_sizes=SMALL,
        interpret=interpret,
    )
    pos = np.broadcast_to(np.arange(T), (B, T))
    visible = sliding_window_visible(
        pos, np.arange(T), window, None if seg is None else np.asarray(seg)
    )
    want = attention_f64(q, k, v, visible, softcap=softcap)
    assert_close(out, want, "float32", TOLERANCES)
    # The jnp reference (what the model's tests use) agrees with the float64 one.
    ref = flash_attention_reference(q, k, v, segment_ids=seg, window=window, softcap=softcap)
    assert_close(ref, want, "float32", TOLERANCES)
    if softcap is not None:  # the cap matters on these inputs
        assert np.abs(attention_f64(q, k, v, visible) - want).max() > 0.05


def test_window_one_sees_only_itself(interpret):
    """window = 1: every query attends to its own key only, so the output is its own value."""
    B, T, G, Hkv = 2, 21, 2, 2
    q, k, v = _inputs(B, T, T, G * Hkv, Hkv, 32, jnp.float32, seed=6)
    out = jaxrl_kernels.flash_attention(q, k, v, window=1, block_sizes=SMALL, interpret=interpret)
    np.testing.assert_allclose(out, jnp.repeat(v, G, axis=2), atol=1e-6, rtol=0)


def test_window_at_least_length_is_no_window(interpret):
    B, T = 1, 40
    q, k, v = _inputs(B, T, T, 4, 2, 32, jnp.float32, seed=7)
    seg = _packed_segments(B, T, seed=7)
    run = functools.partial(
        jaxrl_kernels.flash_attention, segment_ids=seg, block_sizes=SMALL, interpret=interpret
    )
    plain = run(q, k, v)
    for window in (T, T + 13):
        np.testing.assert_allclose(run(q, k, v, window=window), plain, atol=1e-6, rtol=0)


@pytest.mark.parametrize("window,softcap", [(9, None), (9, 1.5), (None, 1.5)])
def test_window_gradient_matches_reference(interpret, window, softcap):
    """dq, dk, dv of the Pallas backward (through the soft cap: its slope 1 - tanh^2) against the
    float64 gradients derived by hand, and the jnp reference's autodiff against those."""
    B, T, G, Hkv = 2, 37, 3, 1
    q, k, v = _inputs(B, T, T, G * Hkv, Hkv, 32, jnp.float32, seed=8)
    w = jax.random.normal(jax.random.key(9), q.shape, jnp.float32)
    seg = _packed_segments(B, T, seed=8)
    loss = lambda fn: lambda q, k, v: jnp.sum(fn(q, k, v) * w)
    kernel = functools.partial(
        jaxrl_kernels.flash_attention,
        segment_ids=seg,
        window=window,
        softcap=softcap,
        block_sizes=SMALL,
        interpret=interpret,
    )
    reference = functools.partial(
        flash_attention_reference, segment_ids=seg, window=window, softcap=softcap
    )
    got = jax.grad(loss(kernel), argnums=(0, 1, 2))(q, k, v)
    visible = sliding_window_visible(
        np.broadcast_to(np.arange(T), (B, T)), np.arange(T), window, np.asarray(seg)
    )
    want = attention_grad_f64(q, k, v, visible, w, softcap=softcap)
    ref = jax.grad(loss(reference), argnums=(0, 1, 2))(q, k, v)
    for g, r, f64 in zip(got, ref, want, strict=True):
        assert_close(g, f64, "float32", GRAD_TOLERANCES)
        assert_close(r, f64, "float32", GRAD_TOLERANCES)
    if softcap is not None:  # the cap's slope matters: the gradients without it differ
        uncapped = attention_grad_f64(q, k, v, visible, w)
        assert max(np.abs(a - b).max() for a, b in zip(uncapped, want, strict=True)) > 0.05


def test_window_skips_blocks_before_it():
    # T = 64, G = 1, blocks of 16, window 16: q block i (queries 16i..16i+15) sees keys from
    # 16i - 15 on, so it starts at kv block i - 1 and needs 2 kv blocks, not i + 1.
    b = np.asarray(_block_bounds(1, 64, 64, 1, 16, 16, True, None, None, 16))[0]
    np.testing.assert_array_equal(b[:, 0], [0, 0, 1, 2])  # lo
    np.testing.assert_array_equal(b[:, 2], [1, 2, 3, 4])  # hi
    assert _kv_steps(64, 64, 1, 16, 16, True, 16) == 2  # TPU kv grid: 2 steps, not 4
    assert _q_steps(64, 64, 1, 16, 16, True, 16) == 2  # kv block j is seen by q blocks j, j + 1
    # Window 20 (not a block multiple): query 48 sees keys from 29 on (kv block 1).
    b = np.asarray(_block_bounds(1, 64, 64, 1, 16, 16, True, None, None, 20))[0]
    np.testing.assert_array_equal(b[:, 0], [0, 0, 0, 1])
    # With segments the later of the two starts wins: document 2 starts at 32.
    seg = jnp.asarray([[1] * 32 + [2] * 32], jnp.int32)
    b = np.asarray(_block_bounds(1, 64, 64, 1, 16, 16, True, seg, seg, 20))[0]
    np.testing.assert_array_equal(b[:, 0], [0, 0, 2, 2])
    # GQA (G = 4): q block of 16 folded rows = 4 tokens; tokens 60..63 with window 8 see 53..63.
    b = np.asarray(_block_bounds(1, 64 * 4, 64, 4, 16, 16, True, None, None, 8))[0]
    assert b[-1, 0] == 3 and b[-1, 2] == 4


@pytest.mark.parametrize(
    "kwargs,match",
    [
        (dict(window=0), "window must be a positive int or None, got 0"),
        (dict(window=2.5), "got 2.5"),
        (dict(window=True), "got True"),
        (dict(window=4, causal=False), "window=4 needs causal=True"),
        (dict(softcap=0.0), "softcap must be a positive finite number or None, got 0.0"),
        (dict(softcap=float("inf")), "got inf"),
        (dict(softcap=True), "got True"),
    ],
)
def test_window_rejects_bad_values(kwargs, match):
    q, k, v = _inputs(1, 8, 8, 2, 2, 16, jnp.float32)
    with pytest.raises(ValueError, match=match):
        jaxrl_kernels.flash_attention(q, k, v, interpret=True, **kwargs)


def test_window_shrinks_the_tpu_grids():
    """T = 128, q blocks of 32, kv blocks of 16, window 16: a q block needs at most 3 kv blocks
    (not all 8) and a kv block is seen by at most 2 q blocks (not all 4), forward and backward."""
    q, k, v = _inputs(1, 128, 128, 1, 1, 32, jnp.float32)
    tpu = dict(backend="tpu", interpret=pltpu.InterpretParams(), block_sizes=SMALL)
    for window, kv_steps, q_steps in ((None, 8, 4), (16, 3, 2)):
        loss = lambda q, k, v, w=window: jaxrl_kernels.flash_attention(
            q, k, v, window=w, **tpu
        ).sum()
        grad = jax.grad(loss, argnums=(0, 1, 2))
        forward, dkv, dq = pallas_grids(grad, q, k, v)
        assert forward == dq == (1, 1, 4, kv_steps)
        assert dkv == (1, 1, 8, q_steps)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
def test_softcap_only_when_set(backend):
    """softcap=None traces no tanh (the uncapped programs are those from before the cap; the
    lowered modules were compared byte for byte when it was added), and a cap reaches the forward
    and both backward kernels (dk/dv and dq) of each body."""
    q, k, v = _inputs(1, 40, 40, 4, 2, 32, jnp.float32)
    interpret = pltpu.InterpretParams() if backend == "tpu" else True

    def kernel_jaxprs(softcap):
        loss = lambda q, k, v: jaxrl_kernels.flash_attention(
            q, k, v, softcap=softcap, backend=backend, interpret=interpret
        ).sum()
        jaxpr = jax.make_jaxpr(jax.grad(loss, argnums=(0, 1, 2)))(q, k, v).jaxpr
        bodies = []

        def visit(jaxpr):
            for eqn in jaxpr.eqns:
                if eqn.primitive.name == "pallas_call":
                    bodies.append(str(eqn.params["jaxpr"]))
                for value in eqn.params.values():
                    for sub in value if isinstance(value, (tuple, list)) else (value,):
                        inner = getattr(sub, "jaxpr", sub)
                        if hasattr(inner, "eqns"):
                            visit(inner)

        visit(jaxpr)
        return bodies

    assert ["tanh" in body for body in kernel_jaxprs(None)] == [False] * 3
    assert ["tanh" in body for body in kernel_jaxprs(2.0)] == [True] * 3
