"""Continuous batching, reproducibility, weight swaps, bad input and sharding of the generator."""

import collections

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.generate import JaxEngine, SamplingParams, Scheduler, sample
from jaxrl.models import create_model
from jaxrl.models.model import abstract_model
from jaxrl.sharding import make_mesh
from jaxrl.testing import tiny_model_config

SP = SamplingParams(max_tokens=10, temperature=1.0, top_k=20, top_p=0.9, seed=5)
PROMPTS = [[1, 2, 3], [9] * 12, [4, 5], list(range(30, 50)), [7, 8, 9, 10, 11]]


@pytest.fixture(scope="module")
def model():
    return create_model(tiny_model_config(), seed=3)


@pytest.fixture(scope="module")
def engine(model):
    return JaxEngine(model, num_slots=4, max_len=48, chunk_steps=4, max_stop_ids=4)


def _key(c):
    return c.request_id, c.sample_index


def _run(engine, requests, one_at_a_time=False):
    sched = Scheduler(engine)
    out = []
    for prompt, sp in requests:
        sched.submit(prompt, sp)
        if one_at_a_time:
            out += sched.run()
    out += sched.run()
    return sorted(out, key=_key), sched.stats


def _requests():
    """Mixed lengths, budgets, n and a stop id, so slots finish at different times."""
    return [(p, SamplingParams(max_tokens=3 + 4 * (i % 3), temperature=1.0, top_k=20, top_p=0.9,
                               n=1 + i % 2, seed=100 + i, stop_token_ids=[i + 40]))
            for i, p in enumerate(PROMPTS)]


def test_same_seed_same_completions_and_other_seed_differs(engine):
    a = sample(engine, PROMPTS, SP)
    b = sample(engine, PROMPTS, SP)
    c = sample(engine, PROMPTS, SamplingParams(**{**SP.__dict__, "seed": 6}))
    assert [x.tokens for x in a] == [x.tokens for x in b]
    assert [x.logprobs for x in a] == [x.logprobs for x in b]
    assert [x.tokens for x in a] != [x.tokens for x in c]


def test_continuous_batching_equals_one_request_at_a_time(engine):
    batched, stats = _run(engine, _requests())
    single, _ = _run(engine, _requests(), one_at_a_time=True)
    assert len(batched) == sum(sp.n for _, sp in _requests())
    for x, y in zip(batched, single, strict=True):
        assert (x.request_id, x.sample_index) == (y.request_id, y.sample_index)
        assert x.tokens == y.tokens and x.finish_reason == y.finish_reason
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-6)
    assert stats.prefills == len(PROMPTS)  # n samples share one prefill
    for c in batched:
        assert len(c.tokens) == len(c.logprobs) == len(c.versions)
        stop = _requests()[c.request_id][1]
        if c.finish_reason == "stop":
            assert c.tokens[-1] in stop.stop_token_ids
        else:
            assert len(c.tokens) == stop.max_tokens
            assert not set(c.tokens) & set(stop.stop_token_ids)


def test_group_samples_differ_and_stop_at_first_token(engine):
    a, b = sample(engine, [[1, 2, 3]], SamplingParams(max_tokens=8, n=2, seed=1))
    assert a.tokens != b.tokens
    (one,) = sample(engine, [[1, 2, 3]], SamplingParams(max_tokens=1, seed=1))
    assert one.tokens == a.tokens[:1] and one.finish_reason == "length"
    (stopped,) = sample(engine, [[1, 2, 3]],
                        SamplingParams(max_tokens=8, seed=1, stop_token_ids=[a.tokens[0]]))
    assert stopped.tokens == a.tokens[:1] and stopped.finish_reason == "stop"


def test_long_tail_keeps_slots_busy(engine):
    short = SamplingParams(max_tokens=4, temperature=1.0, seed=0)
    long = SamplingParams(max_tokens=32, temperature=1.0, seed=0)
    requests = [([i + 1, 2, 3], long if i in (0, 5) else short) for i in range(14)]
    done, stats = _run(engine, requests)
    assert sorted(len(c.tokens) for c in done) == [4] * 12 + [32] * 2
    # Static batches of 4 in arrival order would idle 3 slots for 28 of the long requests' steps.
    static_steps = 2 * 31 + 2 * 3
    static_util = (stats.generated_tokens - len(done)) / (static_steps * engine.num_slots)
    print(f"long tail: slot utilisation {stats.slot_utilisation:.2f} continuous vs "
          f"{static_util:.2f} static batches; {stats.decode_steps} decode steps")
    assert stats.slot_utilisation > 0.7 and stats.decode_steps < static_steps


class _TracingEngine(JaxEngine):
    """Counts how often jax traces each jitted body, per shape: a retrace is a recompile."""

    def __init__(self, *args, **kwargs):
        self.traces = collections.Counter()
        super().__init__(*args, **kwargs)

    def _prefill_rows_impl(self, params, tokens_NP, lengths_N):  # one prompt or several
        self.traces["prefill", tokens_NP.shape] += 1
        return super()._prefill_rows_impl(params, tokens_NP, lengths_N)

    def _insert_impl(self, *args):
        self.traces["insert"] += 1
        return super()._insert_impl(*args)

    def _chunk_impl(self, *args, **kwargs):
        self.traces["chunk", kwargs["num_steps"]] += 1
        return super()._chunk_impl(*args, **kwargs)


def test_set_params_swaps_weights_without_recompiling(model):
    engine = _TracingEngine(model, num_slots=4, max_len=48, chunk_steps=4, max_stop_ids=4)
    graphdef, state = nnx.split(model)
    @jax.jit
    def perturb(state):
        leaves, tree = jax.tree.flatten(state)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        noisy = [x + 0.5 * jax.random.normal(k, x.shape, x.dtype)
                 for x, k in zip(leaves, keys, strict=True)]
        return jax.tree.unflatten(tree, noisy)

    other = perturb(state)
    greedy = SamplingParams(max_tokens=10, temperature=0.0)
    before = sample(engine, PROMPTS[:2], greedy)
    # the probe sees compiles: two prompts prefilled together, the insert, the chunk
    assert set(engine.traces) == {("prefill", (2, 16)), "insert", ("chunk", 4)}, engine.traces
    engine.set_params(other, version=1)
    try:
        after = sample(engine, PROMPTS[:2], greedy)
        # In flight: new weights arrive while a sample is running.
        sched = Scheduler(engine)
        sched.submit(PROMPTS[0], SamplingParams(max_tokens=12, temperature=1.0))
        sched.step()
        sched.set_params(state, version=2)
        (inflight,) = sched.run()
    finally:
        engine.set_params(state, version=0)
    assert ("prefill", (1, 16)) in engine.traces  # the one-prompt prefill ran (compiled) too
    assert set(engine.traces.values()) == {1}, f"set_params caused a recompile: {engine.traces}"
    assert [c.tokens for c in before] != [c.tokens for c in after]
    assert all(c.versions == [0] * 10 for c in before)
    assert all(c.versions == [1] * 10 for c in after)
    n1 = 1 + engine.chunk_steps  # the first token (insert) + one chunk under version 1
    assert inflight.versions == [1] * n1 + [2] * (12 - n1)


def test_set_params_rejects_a_different_model(engine):
    other = nnx.state(abstract_model(tiny_model_config(hidden_size=32)))
    with pytest.raises(ValueError, match=r"set_params: .*embed.* has float32\[128, 32\]"):
        engine.set_params(other, version=1)


@pytest.mark.parametrize("prompt, sp, match", [
    ([], SamplingParams(), "empty prompt"),
    (list(range(40)), SamplingParams(max_tokens=9), r"40 \+ max_tokens 9 = 49 > max_len 48"),
    (list(range(60)), SamplingParams(max_tokens=1), "does not fit the KV cache"),
    ([1, 2], SamplingParams(stop_token_ids=[128]), r"stop_token_ids: token ids \[128\]"),
    ([1, 2], SamplingParams(stop_token_ids=[-1]), "outside the vocabulary"),
    ([1, 500], SamplingParams(), r"prompt: token ids \[500\]"),
    ([1, 2], SamplingParams(stop_token_ids=[1, 2, 3, 4, 5]), "exceed max_stop_ids"),
])
def test_bad_requests_are_rejected(engine, prompt, sp, match):
    sched = Scheduler(engine)
    with pytest.raises(ValueError, match=match):
        sched.submit(prompt, sp)
    assert not sched.has_work()


def test_engine_from_generate_config(model):
    from jaxrl.config import GenerateConfig

    engine = JaxEngine.from_config(model, GenerateConfig(num_slots=4, chunk_steps=2), max_len=32)
    assert (engine.num_slots, engine.max_len, engine.chunk_steps) == (4, 32, 2)
    with pytest.raises(ValueError, match="max_len is 0"):
        JaxEngine.from_config(model, GenerateConfig())


def test_bad_arguments_name_the_value():
    with pytest.raises(ValueError, match="n must be an integer >= 1, got 0"):
        SamplingParams(n=0)
    with pytest.raises(TypeError, match="text prompts need a tokenizer"):  # ids or a tokenizer
        sample(None, "hello", SamplingParams())
    with pytest.raises(ValueError, match="num_slots must be an integer >= 1, got 0"):
        JaxEngine(create_model(tiny_model_config()), num_slots=0, max_len=8)


def test_sharded_generator_mesh_matches_unsharded(model, engine):
    mesh = make_mesh((2, 2), "generator", jax.devices()[4:])  # as make_meshes would: no device 0
    sharded = JaxEngine(model, num_slots=4, max_len=48, chunk_steps=4, max_stop_ids=4, mesh=mesh)
    state = sharded.init_decode_state()
    assert state.cache.k[0].sharding.spec == PartitionSpec("dp", "tp", None, None)  # heads-major
    for sp in (SP, SamplingParams(max_tokens=10, temperature=0.0)):
        want = sample(engine, PROMPTS, sp)
        got = sample(sharded, PROMPTS, sp)
        assert [c.tokens for c in got] == [c.tokens for c in want]
        for x, y in zip(got, want, strict=True):
            np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5)
