"""bf16 dots with f32 results in the generator on CPU (jaxrl/models/lowp_dots.py): what XLA:CPU
compiles with and without them, their numbers against a float64 hand computation, the engine
turning them on for CPU devices only, and the GPU / TPU lowering of the decode step unchanged."""

import operator
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.config import ModelConfig
from jaxrl.generate import JaxEngine
from jaxrl.models import create_model, lowp_dots

BF16 = jnp.bfloat16


def _compiled(*args, wide: bool) -> str:
    def fn(x, w):  # a new function each time: jit's trace cache is keyed by the function
        return lowp_dots.einsum("md,dn->mn", x, w)

    with lowp_dots.wide_results(wide):
        return jax.jit(fn).lower(*args).compile().as_text()


def test_wide_bf16_dot_reads_the_bf16_weight_and_sums_in_f32():
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((32, 256)), BF16)  # a decode step's rows
    w = jnp.asarray(rng.standard_normal((256, 128)), BF16)
    plain, wide = _compiled(x, w, wide=False), _compiled(x, w, wide=True)
    widened = "f32[256,128]{1,0} fusion(%w"  # the weight converted to f32 before the dot
    assert widened in plain, (
        "XLA:CPU no longer converts a bf16 x bf16 -> bf16 dot's weight to f32: check whether "
        "lowp_dots still pays (docs/design.md) before updating this premise")
    assert widened not in wide and "f32[32,128]{1,0} fusion(%x" in wide  # bf16 in, f32 out
    with lowp_dots.wide_results():
        got = np.asarray(lowp_dots.einsum("md,dn->mn", x, w), np.float64)
    exact = np.asarray(x, np.float64) @ np.asarray(w, np.float64)  # bf16 products are exact
    ulp = 2.0 ** (np.floor(np.log2(np.abs(exact))) - 7)  # bf16 keeps 8 significant bits
    assert np.all(np.abs(got - exact) <= ulp), np.max(np.abs(got - exact) / ulp)
    assert lowp_dots.einsum("md,dn->mn", x, w).dtype == BF16  # outside: the plain dot
    with lowp_dots.wide_results():  # only low-precision pairs change
        jaxpr = str(jax.make_jaxpr(lowp_dots.matmul)(x.astype(jnp.float32), w.astype(jnp.float32)))
    assert "convert_element_type" not in jaxpr


def _engine(monkeypatch, platform: str) -> JaxEngine:
    cfg = ModelConfig(architecture="qwen2", vocab_size=96, hidden_size=32, intermediate_size=64,
                      num_layers=1, num_heads=4, num_kv_heads=2, qkv_bias=True,
                      tie_embeddings=True, max_position_embeddings=64, dtype="bfloat16",
                      param_dtype="bfloat16")
    monkeypatch.setattr(JaxEngine, "_platform", lambda self: platform)
    return JaxEngine(create_model(cfg, seed=0), num_slots=2, max_len=16, chunk_steps=2,
                     prefill_buckets=[4])


def _lowered(engine: JaxEngine, platform: str) -> str:
    state = engine.init_decode_state()
    fn = engine._chunk_fns[1]
    return fn.trace(engine.params, state, np.int32(3)).lower(
        lowering_platforms=(platform,)).as_text()


@pytest.mark.parametrize("platform", ["cuda", "tpu"])
def test_decode_step_lowering_unchanged_off_cpu(monkeypatch, platform):
    """An engine on GPU / TPU devices traces the plain dots: its decode step lowers exactly as
    with the calls lowp_dots replaced (`jnp.einsum`, `@`); on CPU devices it differs."""
    device = "gpu" if platform == "cuda" else platform
    off_cpu = _engine(monkeypatch, device)
    assert not off_cpu.wide_dots
    ours = _lowered(off_cpu, platform)
    on_cpu = _engine(monkeypatch, "cpu")
    assert on_cpu.wide_dots
    assert _lowered(on_cpu, platform) != ours
    monkeypatch.setattr(lowp_dots, "einsum", jnp.einsum)
    monkeypatch.setattr(lowp_dots, "matmul", operator.matmul)
    monkeypatch.setattr(lowp_dots, "write_as_bits", lambda write, *args: write(*args))
    monkeypatch.setattr(lowp_dots, "take_rows", operator.getitem)
    assert _lowered(_engine(monkeypatch, device), platform) == ours


@pytest.mark.parametrize("ring", [False, True])
@pytest.mark.parametrize("t", [1, 2])
def test_a_bf16_cache_write_on_cpu_keeps_the_cache_in_bf16(ring, t):
    """XLA:CPU converts a bf16 scatter's whole operand to f32 and back; inside `wide_results`
    the KV cache's per-row writes are a select (one entry a row: a decode step) or a scatter
    on its bits: no cache-sized f32 array, and the same bits written, a ring's dropped
    entries and a slice clamped to fit included."""
    from jaxrl.models.kv_cache import _write_rows, ring_write

    rng = np.random.default_rng(0)
    cache = jnp.asarray(rng.standard_normal((4, 2, 16, 8)), BF16)  # [B, K, S, D]
    new = jnp.asarray(rng.standard_normal((4, 2, t, 8)), jnp.float32)
    start = jnp.asarray([0, 5, 15, 9], jnp.int32)
    if ring:  # row 2 keeps only its first new entry (its length ends there)
        fn = lambda c, n, s: ring_write(c, n, s, s + jnp.asarray([t, t, 1, t]), axis=1)  # noqa: E731
    else:
        fn = lambda c, n, s: _write_rows(c, n, s, 1)  # noqa: E731
    out = {}
    for wide in (False, True):
        with lowp_dots.wide_results(wide):
            compiled = jax.jit(lambda c, n, s: fn(c, n, s)).lower(cache, new, start).compile()
            out[wide] = np.asarray(compiled(cache, new, start)).view(np.uint16)
        entry = compiled.as_text().split("ENTRY")[1]  # arrays made, not a fusion's inside
        widened = any(np.prod([int(n) for n in dims.split(",")]) == cache.size  # any layout
                      for dims in re.findall(r"= f32\[([\d,]+)\]", entry))
        assert widened == (not wide), (wide, "XLA:CPU no longer widens a bf16 scatter: check "
                                             "whether the bf16 cache writes still pay")
    np.testing.assert_array_equal(out[True], out[False])
    expect = np.asarray(cache).view(np.uint16).copy()
    for b, s in enumerate(np.asarray(start)):
        kept = 1 if ring and b == 2 else t
        for i in range(kept):
            at = (s + i) % 16 if ring else min(s, 16 - t) + i  # a slice is moved to fit
            expect[b, :, at] = np.asarray(new[b, :, i].astype(BF16)).view(np.uint16)
    np.testing.assert_array_equal(out[True], expect)


def test_cpu_decode_reads_the_tied_embedding_in_place(monkeypatch):
    """On CPU a bf16 decode chunk neither widens the embedding table to f32 for the token lookup
    (`take_rows` gathers its bits) nor copies it transposed for the lm head (`table_logits`
    puts it on the dot's left): each of those was a whole-table pass per chunk call. The
    numbers: the same rows bit for bit, the logits up to f32 summation order."""
    def entry(engine):  # the arrays the compiled chunk makes, not a fusion's inside
        state = engine.init_decode_state()
        txt = engine._chunk_fns[1].lower(engine.params, state, np.int32(3)).compile().as_text()
        return txt.split("ENTRY")[1]

    widened, transposed = "= f32[96,32]", "= bf16[32,96]"  # the [V, E] table as f32; as [E, V]
    ours = entry(_engine(monkeypatch, "cpu"))
    assert widened not in ours and transposed not in ours
    monkeypatch.setattr(lowp_dots, "take_rows", operator.getitem)
    monkeypatch.setattr(lowp_dots, "table_logits", lambda x, t: jnp.einsum(
        "bte,ve->btv", x, t.astype(x.dtype), preferred_element_type=jnp.float32))
    plain = entry(_engine(monkeypatch, "cpu"))
    assert widened in plain and transposed in plain, (
        "XLA:CPU no longer widens a bf16 gather or copies a dot's transposed right operand: "
        "check whether take_rows / table_logits still pay (docs/design.md)")
    monkeypatch.undo()

    rng = np.random.default_rng(0)
    table = jnp.asarray(rng.standard_normal((96, 32)), BF16)
    idx = jnp.asarray([[0, 95, 7]], jnp.int32)
    x = jnp.asarray(rng.standard_normal((2, 1, 32)), BF16)
    with lowp_dots.wide_results():
        rows = jax.jit(lowp_dots.take_rows)(table, idx)
        logits = jax.jit(lowp_dots.table_logits)(x, table)
    np.testing.assert_array_equal(np.asarray(rows).view(np.uint16),
                                  np.asarray(table[idx]).view(np.uint16))
    want = np.einsum("bte,ve->btv", np.asarray(x, np.float64), np.asarray(table, np.float64))
    assert logits.dtype == jnp.float32 and logits.shape == (2, 1, 96)
    np.testing.assert_allclose(np.asarray(logits), want, rtol=1e-5, atol=1e-5)
