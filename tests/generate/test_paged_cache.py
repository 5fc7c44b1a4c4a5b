"""The paged KV cache (`kv_layout="paged"`) against the contiguous one: same tokens and logprobs."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec

from jaxrl.config import ConfigError, GenerateConfig, RunConfig, apply_override
from jaxrl.generate import JaxEngine, SamplingParams, Scheduler
from jaxrl.models import KVCache, create_model
from jaxrl.models.paged import PagedKVCache, paged_attention
from jaxrl.sharding import make_mesh
from jaxrl.testing import tiny_model_config

# Lengths straddle page boundaries (page sizes 8 and 16; none a multiple of either).
PROMPTS = [[1, 2, 3], [9] * 12, [4, 5], list(range(30, 55)), [7, 8, 9, 10, 11], list(range(60, 77))]
MAX_LEN = 40  # not a multiple of the page size either: the last page is partly unused


def _requests():
    """Greedy and sampled requests with mixed budgets, n and stop ids, so slots finish at
    different times and the scheduler refills them (3 slots, 9 samples)."""
    out = []
    for i, p in enumerate(PROMPTS):
        budget = min(12, MAX_LEN - len(p)) - 2 * (i % 2)
        temperature = 0.0 if i % 2 == 0 else 1.0
        out.append((p, SamplingParams(max_tokens=budget, temperature=temperature, top_k=20,
                                      n=1 + (i % 3 == 1), seed=50 + i,
                                      stop_token_ids=[i + 40])))
    return out


def _run(engine):
    sched = Scheduler(engine)
    for prompt, sp in _requests():
        sched.submit(prompt, sp)
    return sorted(sched.run(), key=lambda c: (c.request_id, c.sample_index))


# (attention_impl, page_size): "pallas" runs jaxrl_kernels.paged_decode_attention (interpreted on
# CPU; its GPU body needs a power of two >= 16), "xla" gathers pages; 8 gives more page boundaries.
@functools.cache
def _engines(impl: str, page_size: int):
    """(contiguous, paged) engines of one model, built once per module run."""
    model = create_model(tiny_model_config(attention_impl=impl), seed=3)
    kw = dict(num_slots=3, max_len=MAX_LEN, chunk_steps=4, max_stop_ids=4)
    return (JaxEngine(model, **kw),
            JaxEngine(model, kv_layout="paged", page_size=page_size, **kw))


@pytest.fixture(scope="module", params=[("xla", 8), ("pallas", 16)], ids=["xla", "pallas"])
def engines(request):
    return _engines(*request.param)


def test_paged_generation_equals_contiguous_token_for_token(engines):
    contiguous, paged = engines
    want, got = _run(contiguous), _run(paged)
    assert len(got) == len(want) == sum(sp.n for _, sp in _requests())
    for x, y in zip(got, want, strict=True):
        assert (x.request_id, x.sample_index) == (y.request_id, y.sample_index)
        assert x.tokens == y.tokens, f"request {x.request_id} sample {x.sample_index}"
        assert x.finish_reason == y.finish_reason and x.versions == y.versions
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)
    # Some samples wrote past a page boundary while decoding: prompt positions end at p - 1,
    # generated tokens (all but the last) are written at p .. p + n - 2.
    spans = [(len(_requests()[c.request_id][0]), len(c.tokens)) for c in got]
    assert any((p - 1) // paged.page_size != (p + n - 2) // paged.page_size for p, n in spans)


def test_paged_decode_state_layout(engines):
    _, paged = engines
    cache = paged.init_decode_state().cache
    cfg, p = paged.cfg, -(-MAX_LEN // paged.page_size)
    assert isinstance(cache, PagedKVCache) and len(cache.k_pages) == cfg.num_layers
    assert cache.k_pages[0].shape == (3 * p, paged.page_size, cfg.num_kv_heads, cfg.head_size)
    # Static allocation: slot b owns pages [b * p, (b + 1) * p).
    np.testing.assert_array_equal(cache.page_table_BP, np.arange(3 * p).reshape(3, p))


@pytest.mark.parametrize("impl, page_size", [("xla", 8), ("pallas", 16)], ids=["xla", "pallas"])
def test_paged_on_a_generator_mesh_equals_unsharded(impl, page_size):
    """Pages over "dp" with their slots, kv heads over "tp"; traced under `jax.set_mesh`, the
    Pallas kernel runs per shard (`jax.shard_map`) on each shard's slice of the page pool."""
    contiguous, paged = _engines(impl, page_size)
    mesh = make_mesh((2, 2), "generator", jax.devices()[4:])  # as make_meshes would: no device 0
    sharded = JaxEngine(nnx.merge(paged.graphdef, paged.params.state), num_slots=4,
                        max_len=MAX_LEN, chunk_steps=4, max_stop_ids=4, mesh=mesh,
                        kv_layout="paged", page_size=page_size)
    with jax.set_mesh(mesh):
        cache = sharded.init_decode_state().cache
        assert cache.k_pages[0].sharding.spec == PartitionSpec("dp", None, "tp", None)
        assert cache.page_table_BP.sharding.spec == PartitionSpec("dp", None)
        q = jnp.zeros((4, 1, paged.cfg.num_heads, paged.cfg.head_size))
        decode = lambda c: paged_attention(q, c.k_pages[0], c.v_pages[0], c.page_table_BP,
                                           c.lengths_B[:, None], c.lengths_B + 1, impl=impl)
        assert ("shard_map" in str(jax.make_jaxpr(decode)(cache))) == (impl == "pallas")
        got = _run(sharded)
    want = _run(contiguous)
    assert [c.tokens for c in got] == [c.tokens for c in want]
    for x, y in zip(got, want, strict=True):
        np.testing.assert_allclose(x.logprobs, y.logprobs, atol=1e-5, rtol=0)


@pytest.mark.parametrize("impl", ["xla", "pallas"])
def test_model_decode_through_a_shuffled_page_table(impl):
    """Chunked prefill (T > 1, gathered XLA path) then one-token steps (the kernel for "pallas")
    through a permuted page table equal the contiguous cache."""
    cfg = tiny_model_config(attention_impl=impl)
    model = create_model(cfg, seed=1)
    b, max_len, page_size = 2, 40, 16
    perm = np.random.default_rng(0).permutation(b * 3).astype(np.int32).reshape(b, 3)
    paged = dataclasses.replace(PagedKVCache.init(cfg, b, max_len, page_size),
                                page_table_BP=jnp.asarray(perm))
    dense = KVCache.init(cfg, b, max_len)
    tokens = jnp.asarray(np.random.default_rng(1).integers(0, cfg.vocab_size, (b, 30)), jnp.int32)
    steps = [(tokens[:, :13], jnp.asarray([13, 9])), (tokens[:, 13:20], None)]
    steps += [(tokens[:, i:i + 1], None) for i in range(20, 23)]
    for chunk, num_valid in steps:
        want, dense = model.decode(chunk, dense, num_valid)
        got, paged = model.decode(chunk, paged, num_valid)
        np.testing.assert_allclose(got, want, atol=1e-5, rtol=0)
        np.testing.assert_array_equal(paged.lengths_B, dense.lengths_B)
    assert int(paged.lengths_B[0]) > page_size  # the steps crossed into a second page

    # impl "pallas" with one query per row is the paged kernel; "xla" never is.
    q = jnp.zeros((b, 1, cfg.num_heads, cfg.head_size))
    args = (paged.k_pages[0], paged.v_pages[0], paged.page_table_BP, paged.lengths_B[:, None],
            paged.lengths_B + 1)
    jaxpr = str(jax.make_jaxpr(lambda *a: paged_attention(q, *a, impl=impl))(*args))
    assert ("paged_decode" in jaxpr) == (impl == "pallas")


def test_bad_kv_layout_is_rejected():
    with pytest.raises(ConfigError, match=r"generate.kv_layout: invalid value 'ring'; "
                                          r"valid choices: \['contiguous', 'paged'\]"):
        GenerateConfig(kv_layout="ring")
    with pytest.raises(ConfigError, match=r"valid choices: \['contiguous', 'paged'\]"):
        apply_override(RunConfig(), "generate.kv_layout", "ring")
    with pytest.raises(ConfigError, match="generate.page_size: must be > 0, got 0"):
        GenerateConfig(page_size=0)
    model = create_model(tiny_model_config())
    with pytest.raises(ValueError, match=r"invalid kv_layout 'ring'; valid choices: "
                                         r"\['contiguous', 'paged'\]"):
        JaxEngine(model, num_slots=1, max_len=8, kv_layout="ring")


def test_engine_from_config_uses_the_paged_layout():
    model = create_model(tiny_model_config())
    cfg = apply_override(RunConfig(), "generate.kv_layout", "paged").generate
    engine = JaxEngine.from_config(model, dataclasses.replace(cfg, num_slots=2, page_size=8),
                                   max_len=20)
    assert (engine.kv_layout, engine.page_size) == ("paged", 8)
    cache = jax.eval_shape(engine._empty_state).cache
    assert isinstance(cache, PagedKVCache) and cache.page_table_BP.shape == (2, 3)
