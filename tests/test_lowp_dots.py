"""bf16 dots with f32 results in the generator on CPU (jaxrl/models/lowp_dots.py): what XLA:CPU
compiles with and without them, their numbers against a float64 hand computation, the engine
turning them on for CPU devices only, and the GPU / TPU lowering of the decode step unchanged."""

import operator
import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

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


def _cfg(**kw) -> ModelConfig:
    return ModelConfig(**{**dict(
        architecture="qwen2", vocab_size=96, hidden_size=32, intermediate_size=80, num_layers=1,
        num_heads=4, num_kv_heads=2, qkv_bias=True, tie_embeddings=True,
        max_position_embeddings=64, dtype="bfloat16", param_dtype="bfloat16"), **kw})


def _engine(monkeypatch, platform: str, model=None) -> JaxEngine:
    monkeypatch.setattr(JaxEngine, "_platform", lambda self: platform)
    return JaxEngine(model or create_model(_cfg(), seed=0), num_slots=2, max_len=16,
                     chunk_steps=2, prefill_buckets=[4])


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
    monkeypatch.setattr(lowp_dots, "gated", lambda act, gate, up: act(gate) * up)
    assert _lowered(_engine(monkeypatch, device), platform) == ours


@pytest.mark.parametrize("dtype", [jnp.float32, BF16])
def test_a_wide_contraction_over_two_axes_is_one_dot_without_transposes(dtype):
    """o's `bthd,hde->bte`: `jnp.einsum` orders the contracted axes `d, h`, and XLA:CPU then
    transposes the whole weight and the input at every call; inside `wide_results` it is one
    `[B*T, H*D] @ [H*D, E]` dot on the arrays as they lie, with the same sums (up to order)."""
    rng = np.random.default_rng(5)
    x = jnp.asarray(rng.normal(size=(6, 1, 8, 16)), dtype)
    w = jnp.asarray(rng.normal(size=(8, 16, 32)), dtype)

    def o_proj(x, w):
        return lowp_dots.einsum("bthd,hde->bte", x, w)

    plain = jax.jit(o_proj)
    transposes = re.compile(r"= \S+ transpose\(")
    assert transposes.search(plain.lower(x, w).compile().as_text())  # what the flat dot avoids
    with lowp_dots.wide_results(True):
        wide = jax.jit(lambda x, w: o_proj(x, w))
        hlo = wide.lower(x, w).compile().as_text()
        got = wide(x, w)
    assert not transposes.search(hlo) and got.shape == (6, 1, 32) and got.dtype == dtype
    want = np.einsum("bthd,hde->bte", np.asarray(x, np.float64), np.asarray(w, np.float64))
    tol = 5e-2 if dtype == BF16 else 1e-4
    np.testing.assert_allclose(np.asarray(got, np.float64), want, rtol=tol, atol=tol)
    # a spec of another form keeps jnp.einsum (here: the weight's contracted axes reversed)
    assert lowp_dots._flat_dot("bthd,dhe->bte", x, w.transpose(1, 0, 2)) is None


def test_a_wide_glu_activation_rounds_once():
    """Inside `wide_results` a bf16 `silu(gate) * up` is computed in f32 and rounded once (as a
    fused SiLU-and-multiply kernel), not rounded to bf16 after each of its five steps; outside,
    and for f32, it is the plain expression."""
    rng = np.random.default_rng(0)
    gate, up = (jnp.asarray(rng.standard_normal((64, 96)) * 3, BF16) for _ in range(2))
    once = (jax.nn.silu(gate.astype(jnp.float32)) * up.astype(jnp.float32)).astype(BF16)
    with lowp_dots.wide_results(True):
        wide = jax.jit(lambda g, u: lowp_dots.gated(jax.nn.silu, g, u))(gate, up)
        f32 = lowp_dots.gated(jax.nn.silu, gate.astype(jnp.float32), up.astype(jnp.float32))
    np.testing.assert_array_equal(np.asarray(wide, np.float32), np.asarray(once, np.float32))
    plain = jax.nn.silu(gate) * up
    np.testing.assert_array_equal(np.asarray(lowp_dots.gated(jax.nn.silu, gate, up), np.float32),
                                  np.asarray(plain, np.float32))
    assert not np.array_equal(np.asarray(plain, np.float32), np.asarray(once, np.float32))
    np.testing.assert_array_equal(np.asarray(f32), np.asarray(jax.nn.silu(gate.astype(
        jnp.float32)) * up.astype(jnp.float32)))


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


def _chunk_entry(engine: JaxEngine) -> str:
    """The arrays a compiled decode chunk makes (its entry computation, not a fusion's inside)."""
    state = engine.init_decode_state()
    txt = engine._chunk_fns[1].lower(engine.params, state, np.int32(3)).compile().as_text()
    return txt.split("ENTRY")[1]


def test_cpu_decode_reads_the_tied_embedding_in_place(monkeypatch):
    """On CPU a bf16 decode chunk neither widens the embedding table to f32 for the token lookup
    (`take_rows` gathers its bits) nor copies it transposed for the lm head (`table_logits`
    puts it on the dot's left): each of those was a whole-table pass per chunk call. The
    numbers: the same rows bit for bit, the logits up to f32 summation order."""
    entry = _chunk_entry

    widened, transposed = "= f32[96,32]", "= bf16[32,96]"  # the [V, E] table as f32; as [E, V]
    ours = entry(_engine(monkeypatch, "cpu"))
    assert widened not in ours and transposed not in ours
    monkeypatch.setattr(lowp_dots, "take_rows", operator.getitem)
    def plain_logits(x, table, vocab_major=False):
        out = jnp.einsum("bte,ve->btv", x, table.astype(x.dtype),
                         preferred_element_type=jnp.float32)
        return jnp.transpose(out, (2, 0, 1)) if vocab_major else out

    monkeypatch.setattr(lowp_dots, "table_logits", plain_logits)
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


def test_a_cpu_engine_holds_its_bf16_projections_out_in(monkeypatch):
    """On CPU a bf16 engine holds each projection [out, in] (`Transformer.hold_out_in`) from the
    caller's layout, at construction and in `set_params`, and contracts it as one 2-D dot, so no
    weight is copied back to [in, out] per chunk call; decoding gives the tokens and
    log-probabilities of an engine holding the caller's layout. f32 engines and LoRA models
    keep the caller's layout; the caller's model is left as it was."""
    from jaxrl.models.transformer import Transformer

    model = create_model(_cfg(num_layers=2), seed=0)
    gate = model.layers[0].mlp.gate_proj[...]
    engine = _engine(monkeypatch, "cpu", model)
    assert engine.out_in and model.layers[0].mlp.gate_proj[...] is gate  # caller's untouched
    held = nnx.merge(engine.graphdef, engine.params.state)
    mlp, attn = held.layers[0].mlp, held.layers[0].attn
    assert mlp.out_in and attn.out_in
    np.testing.assert_array_equal(np.asarray(mlp.gate_proj[...]), np.asarray(gate).T)
    assert attn.q_proj[...].shape == (4, 8, 32) and attn.o_proj[...].shape == (32, 4, 8)
    canonical = re.compile(r"= bf16\[32,80\]\S* (copy|fusion|transpose)\(")  # gate as [E, F]
    assert not canonical.search(_chunk_entry(engine))
    with monkeypatch.context() as m:  # the premise: a 3-D einsum on the held weight copies it
        m.setattr(lowp_dots, "einsum_out_in", lowp_dots.einsum)
        assert canonical.search(_chunk_entry(_engine(m, "cpu", model))), (
            "XLA:CPU no longer copies a 3-D einsum's [out, in] weight: check whether "
            "einsum_out_in still pays (docs/design.md)")

    def decode(engine, weights=None):
        if weights is not None:
            engine.set_params(weights, 1)
        from jaxrl.generate import SamplingParams, Scheduler
        sched = Scheduler(engine)
        for p in ([1, 2, 3], [7, 8]):
            sched.submit(p, SamplingParams(max_tokens=6, temperature=0.0))
        done = sorted(sched.run(), key=lambda c: len(c.prompt))
        return [c.tokens for c in done], np.array([c.logprobs for c in done])

    other = create_model(_cfg(num_layers=2), seed=1)
    with monkeypatch.context() as m:  # the same engine holding the caller's layout
        m.setattr(Transformer, "hold_out_in", lambda self: self)
        plain = _engine(m, "cpu", model)
        want = decode(plain), decode(plain, nnx.state(other))
    got = decode(engine), decode(engine, other)
    for (tokens, logp), (want_tokens, want_logp) in zip(got, want, strict=True):
        assert tokens == want_tokens
        np.testing.assert_allclose(logp, want_logp, atol=2e-2)
    assert not _engine(monkeypatch, "cpu", create_model(_cfg(dtype="float32",
                                                            param_dtype="float32"))).out_in


def test_a_cpu_prefill_holds_its_rotations_as_constants(monkeypatch):
    """A CPU engine's prefill takes the prompt's rotary tables as constants
    (`prompt_rope_tables`): computed in the step, XLA:CPU fuses cos and sin into every head's
    rotation and evaluates them per head. The prefix is the one an in-step table gives: the
    cache and the last logits equal, and those logits equal the plain forward pass's."""
    tokens, lengths = np.array([[5, 9, 17, 2], [40, 3, 0, 0]], np.int32), np.array([4, 2])
    # the plain engine below also traces the plain dots and GLU; the GLU's single rounding
    # (`lowp_dots.gated`) would differ from them, so both engines here take the plain one
    monkeypatch.setattr(lowp_dots, "gated", lambda act, gate, up: act(gate) * up)

    def prefill(engine):
        fn = engine._prefill_rows_fn
        txt = fn.lower(engine.params, tokens, lengths).compile().as_text()
        return txt.count("cosine("), fn(engine.params, tokens, lengths)

    model = create_model(_cfg(num_layers=2), seed=0)
    n_cos, ours = prefill(_engine(monkeypatch, "cpu", model))
    plain_engine = JaxEngine(model, num_slots=2, max_len=16, chunk_steps=2, prefill_buckets=[4])
    plain_engine.wide_dots = False  # the rotations computed in the step, as off CPU
    n_cos_plain, plain = prefill(plain_engine)
    assert n_cos == 0 and n_cos_plain > 0, (n_cos, n_cos_plain)
    for a, b in zip(ours, plain, strict=True):
        for x, y in zip(a.cache.k + a.cache.v, b.cache.k + b.cache.v, strict=True):
            np.testing.assert_array_equal(np.asarray(x, np.float32), np.asarray(y, np.float32))
    with lowp_dots.wide_results():
        want = jax.jit(lambda t: model(t))(tokens)
    for r, n in enumerate(lengths):
        np.testing.assert_allclose(np.asarray(ours[r].logits_V), np.asarray(want[r, n - 1]),
                                   rtol=2e-2, atol=2e-2)


def test_a_cpu_decode_step_reads_its_rotations_from_a_table(monkeypatch):
    """A CPU engine's decode step gathers its rotations from the tables of every position
    (`table_rope`, loop-invariant: computed once per chunk call). Without them XLA:CPU
    evaluates cos and sin inside each head's rotation at every step. Greedy decoding gives the
    same tokens either way."""
    import jaxrl.generate.engine as engine_module

    def cosines(engine):  # the shapes of the compiled chunk's cos evaluations
        txt = engine._chunk_fns[1].lower(engine.params, engine.init_decode_state(),
                                         np.int32(3)).compile().as_text()
        return re.findall(r"= f32\[([\d,]+)\]\{[\d,]*\} cosine\(", txt)

    def greedy(engine):
        state = engine.insert(engine.prefill(engine.params, [5, 9, 17]),
                              engine.init_decode_state(), 0, engine.slot_params(
                                  key_data=np.zeros(2, np.uint32), sample_index=0,
                                  temperature=0.0, top_k=0, top_p=1.0, max_tokens=8,
                                  stop_token_ids=[]))
        tokens = []
        for _ in range(6):
            state, res = engine.generate(engine.params, state)
            tokens.append(int(res.tokens_CB[1, 0]))
        return tokens

    model = create_model(_cfg(num_layers=2), seed=0)
    ours = _engine(monkeypatch, "cpu", model)
    assert cosines(ours) == ["1,16,4"], cosines(ours)  # the [1, max_len, D/2] table alone
    tokens = greedy(ours)
    monkeypatch.setattr(engine_module, "table_rope", lambda cfg, positions, max_len: None)
    plain = _engine(monkeypatch, "cpu", model)
    assert len(cosines(plain)) > 1, "XLA:CPU no longer fuses cos into each rotation"
    assert greedy(plain) == tokens
