"""Prompts prefilled together (`JaxEngine.prefill_many`, used by the `Scheduler`) give the
prefixes, and so the completions, that one prompt at a time gives."""

import jax
import numpy as np
import pytest

from jaxrl.generate import JaxEngine, SamplingParams, Scheduler
from jaxrl.models import create_model
from jaxrl.rounding import power_of_two_parts
from jaxrl.sharding import make_mesh
from jaxrl.testing import tiny_model_config

# two buckets (16 and 32), five prompts in the first: calls of 4 + 1 rows (max_rows 8)
PROMPTS = [[1, 2, 3], [9] * 12, [4, 5], list(range(30, 50)), [7, 8, 9, 10, 11], [3] * 16,
           list(range(60, 85))]
KW = dict(num_slots=8, max_len=48, chunk_steps=4, max_stop_ids=4)
MOE = dict(architecture="qwen3_moe", qk_norm=True, num_experts=4, experts_per_token=2,
           moe_intermediate_size=16, num_layers=3)


@pytest.fixture(scope="module")
def model():
    return create_model(tiny_model_config(), seed=3)


def _assert_same_prefix(got, want, length):
    np.testing.assert_allclose(np.asarray(got.logits_V), np.asarray(want.logits_V),
                               rtol=1e-5, atol=1e-5)
    assert int(got.true_length) == int(want.true_length) == length
    np.testing.assert_array_equal(np.asarray(got.cache.lengths_B), np.asarray(want.cache.lengths_B))
    assert got.cache.heads_major == want.cache.heads_major
    for a, b in zip(got.cache.k + got.cache.v, want.cache.k + want.cache.v, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5, atol=1e-5)
    if want.experts_LPK is None:
        assert got.experts_LPK is None
    else:
        np.testing.assert_array_equal(np.asarray(got.experts_LPK)[:, :length],
                                      np.asarray(want.experts_LPK)[:, :length])


@pytest.mark.parametrize("case", ["dense", "paged", "moe"])
def test_prefill_many_equals_one_prompt_at_a_time(model, case):
    if case == "moe":
        model = create_model(tiny_model_config(**MOE), seed=4)
    layout = dict(kv_layout="paged", page_size=8) if case == "paged" else {}
    engine = JaxEngine(model, **KW, **layout)
    got = engine.prefill_many(engine.params, PROMPTS, max_rows=8)
    for prompt, prefix in zip(PROMPTS, got, strict=True):
        _assert_same_prefix(prefix, engine.prefill(engine.params, prompt), len(prompt))


def test_prefill_many_pads_a_call_only_where_that_wastes_little(model):
    """Seven prompts of one bucket run as one call of 8 rows (a padding row), nine as 8 + 1."""
    engine = JaxEngine(model, **KW)
    rows = []
    real = engine._prefill_rows_fn
    engine._prefill_rows_fn = lambda p, tokens, lengths: (rows.append(len(lengths)),
                                                          real(p, tokens, lengths))[1]
    prompts = [[i + 1] * (2 + i) for i in range(9)]  # lengths 2..10: all in the 16 bucket
    for n, calls in ((7, [8]), (9, [8])):  # the ninth prompt goes through `prefill`
        rows.clear()
        got = engine.prefill_many(engine.params, prompts[:n], max_rows=16)
        assert rows == calls
        for prompt, prefix in zip(prompts[:n], got, strict=True):
            _assert_same_prefix(prefix, engine.prefill(engine.params, prompt), len(prompt))


def test_power_of_two_parts():
    assert [power_of_two_parts(n, 16) for n in (0, 1, 3, 5, 6, 7, 9, 12, 13, 14, 16, 17)] == [
        [], [1], [4], [4, 1], [4, 2], [8], [8, 1], [8, 4], [8, 4, 1], [16], [16], [16, 1]]
    assert power_of_two_parts(20, 12) == [8, 8, 4]  # never above the largest power <= limit
    assert power_of_two_parts(15, 8) == [8, 8]  # the second call: 7 rows and one padding row
    for bad in ((-1, 16), (3, 0), (2.5, 16)):
        with pytest.raises(ValueError, match="power_of_two_parts"):
            power_of_two_parts(*bad)


def test_prefill_many_splits_rows_over_dp_and_caps_the_rows(model):
    mesh = make_mesh((2, 2), "generator", jax.devices()[:4])  # dp 2 x tp 2
    engine = JaxEngine(model, mesh=mesh, **KW)
    got = engine.prefill_many(engine.params, PROMPTS, max_rows=2)
    for prompt, prefix in zip(PROMPTS, got, strict=True):
        _assert_same_prefix(prefix, engine.prefill(engine.params, prompt), len(prompt))
    with pytest.raises(ValueError, match="prompt 1 is empty"):
        engine.prefill_many(engine.params, [[1], []])
    with pytest.raises(ValueError, match="max_rows"):
        engine.prefill_many(engine.params, PROMPTS, max_rows=0)


def _completions(engine, *, batched):
    engine.batched_prefill = batched  # the instance's choice, for this comparison
    calls = {"one": 0, "many": 0}
    one, many = engine.prefill, engine.prefill_many
    engine.prefill = lambda *a, **k: (calls.__setitem__("one", calls["one"] + 1), one(*a, **k))[1]
    engine.prefill_many = lambda *a, **k: (calls.__setitem__("many", calls["many"] + 1),
                                           many(*a, **k))[1]
    try:
        sched = Scheduler(engine)
        for i, prompt in enumerate(PROMPTS):
            temperature = 0.0 if i % 2 else 1.0
            sched.submit(prompt, SamplingParams(max_tokens=6, temperature=temperature, top_k=20,
                                                n=1 + i % 3, seed=10 + i))
        out = sorted(sched.run(), key=lambda c: (c.request_id, c.sample_index))
        return out, sched.stats, calls
    finally:
        del engine.prefill, engine.prefill_many, engine.batched_prefill


def test_scheduler_prefills_together_and_completes_the_same(model):
    engine = JaxEngine(model, **KW)
    plain, plain_stats, plain_calls = _completions(engine, batched=False)
    batched, stats, calls = _completions(engine, batched=True)
    assert [(c.tokens, c.finish_reason) for c in batched] == [
        (c.tokens, c.finish_reason) for c in plain]
    np.testing.assert_allclose([lp for c in batched for lp in c.logprobs],
                               [lp for c in plain for lp in c.logprobs], rtol=1e-5, atol=1e-6)
    assert stats.prefills == plain_stats.prefills == len(PROMPTS)
    assert stats.prompt_tokens == plain_stats.prompt_tokens == sum(map(len, PROMPTS))
    assert plain_calls == {"one": len(PROMPTS), "many": 0}
    # 8 slots take the first prompts' samples together; the rest as slots free up
    assert calls["many"] >= 1 and calls["one"] < len(PROMPTS)
