"""attention_impl="pallas" on a mesh: with params and inputs sharded on a 2 x 2 trainer mesh
(fsdp x tp) the model's logits and a loss's gradient equal impl="xla", and decode on a 2 x 2
generator mesh (dp x tp) gives the same logits and greedy tokens; the kernels run inside
`jax.shard_map` (batch over the data axis, kv heads over "tp"), or whole where an axis does not
divide."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from kernel_testing import GRAD_TOLERANCES, TOLERANCES, assert_close

from jaxrl.models.attention import kernel_shard_axes
from jaxrl.models.model import create_model
from jaxrl.models.transformer import KVCache
from jaxrl.sharding import logical_sharding, make_mesh
from jaxrl.testing import tiny_model_config

# GQA 4 (8 query heads, 2 kv heads: one per "tp" device), head_dim 16.
MODEL = dict(hidden_size=64, num_heads=8, num_kv_heads=2, head_dim=16)


def _mesh(role):
    return make_mesh((2, 2), role, jax.devices()[:4])


def _split(impl, mesh, role):
    cfg = tiny_model_config(attention_impl=impl, **MODEL)
    return nnx.split(create_model(cfg, mesh=mesh, role=role, seed=0))


def _has_shard_map(fn, *args):
    return "shard_map" in str(jax.make_jaxpr(fn)(*args))


def test_kernel_shard_axes():
    assert kernel_shard_axes(4, 2) is None  # no mesh in context
    with jax.set_mesh(make_mesh((1, 1), "trainer", jax.devices()[:1])):
        assert kernel_shard_axes(4, 2) is None
    with jax.set_mesh(_mesh("trainer")):
        assert kernel_shard_axes(4, 2)[1:] == ("fsdp", "tp")
        assert kernel_shard_axes(3, 2)[1:] == (None, "tp")  # odd batch: replicated
        assert kernel_shard_axes(3, 1) is None
    with jax.set_mesh(_mesh("generator")):
        assert kernel_shard_axes(2, 4)[1:] == ("dp", "tp")
        assert kernel_shard_axes(2, 3)[1:] == ("dp", None)


@pytest.mark.parametrize("batch", [2, 3])  # 3: batch does not divide "fsdp" and is replicated
def test_trainer_mesh_logits_and_grad_pallas_match_xla(batch):
    mesh = _mesh("trainer")
    tokens_BT = jnp.asarray([[3, 14, 15, 92, 65, 35, 89, 79, 32, 38, 46, 26]] * batch, jnp.int32)
    tokens_BT = (tokens_BT + jnp.arange(batch)[:, None]) % 128
    segments_BT = jnp.asarray([[1] * 5 + [2] * 5 + [0] * 2] * batch, jnp.int32)  # 2 docs + pad
    rows = lambda x: logical_sharding(mesh, "trainer", ("batch", "length"), x.shape)
    tokens_BT, segments_BT = (jax.device_put(x, rows(x)) for x in (tokens_BT, segments_BT))

    def fwd_and_grad(impl):
        graphdef, state = _split(impl, mesh, "trainer")

        def loss(state):
            logits_BTV = nnx.merge(graphdef, state)(tokens_BT, segment_ids_BT=segments_BT)
            logp_BT = jnp.take_along_axis(
                jax.nn.log_softmax(logits_BTV), tokens_BT[:, :, None], axis=-1
            )[..., 0]
            return -jnp.mean(logp_BT), logits_BTV

        step = jax.jit(jax.value_and_grad(loss, has_aux=True))
        with jax.set_mesh(mesh):
            assert _has_shard_map(step, state) == (impl == "pallas")
            (_, logits_BTV), grads = step(state)
        return logits_BTV, grads

    logits, grads = fwd_and_grad("pallas")
    want_logits, want_grads = fwd_and_grad("xla")
    assert_close(logits, want_logits, "float32")
    for g, w in zip(jax.tree.leaves(grads), jax.tree.leaves(want_grads), strict=True):
        assert_close(g, w, "float32", GRAD_TOLERANCES)


def test_generator_mesh_greedy_decode_pallas_equals_xla():
    """Prefill two prompts (lengths 5 and 3) into a cache sharded over slots ("dp") and kv heads
    ("tp"), then greedy one-token steps (`cached_attention` -> decode kernel)."""
    mesh = _mesh("generator")
    prompts_BT = jnp.asarray([[5, 17, 3, 99, 42], [7, 30, 31, 0, 0]], jnp.int32)
    num_valid_B = jnp.asarray([5, 3], jnp.int32)
    cfg = tiny_model_config(**MODEL)

    def run(impl):
        graphdef, state = _split(impl, mesh, "generator")
        # each impl's own cache layout: XLA heads-major, the kernel [B, S, K, D]
        heads_major = impl == "xla"
        cache = KVCache.init(cfg, batch=2, max_len=16, heads_major=heads_major)
        spec = lambda x, which: logical_sharding(
            mesh, "generator", KVCache.logical_axes(which, heads_major), x.shape)
        cache = KVCache(
            k=[jax.device_put(x, spec(x, "k")) for x in cache.k],
            v=[jax.device_put(x, spec(x, "v")) for x in cache.v],
            lengths_B=cache.lengths_B, heads_major=heads_major,
        )

        @jax.jit
        def prefill(state, cache):
            h_BTE, cache = nnx.merge(graphdef, state).decode_hidden(prompts_BT, cache, num_valid_B)
            last_BE = h_BTE[jnp.arange(2), num_valid_B - 1]
            return nnx.merge(graphdef, state).logits(last_BE[:, None])[:, 0], cache

        @jax.jit
        def step(state, cache, token_B):
            logits_BTV, cache = nnx.merge(graphdef, state).decode(token_B[:, None], cache)
            return logits_BTV[:, 0], cache

        all_logits = []
        with jax.set_mesh(mesh):
            logits_BV, cache = prefill(state, cache)
            token_B = jnp.argmax(logits_BV, -1)
            assert _has_shard_map(step, state, cache, token_B) == (impl == "pallas")
            for _ in range(3):
                logits_BV, cache = step(state, cache, token_B)
                all_logits.append(logits_BV)
                token_B = jnp.argmax(logits_BV, -1)
        return jnp.stack(all_logits, 1)

    got, want = run("pallas"), run("xla")
    assert_close(got, want, "float32")
    np.testing.assert_array_equal(np.argmax(got, -1), np.argmax(want, -1))


def test_generator_engine_on_a_mesh_pallas_equals_xla():
    """The generator (`JaxEngine` + scheduler) on a dp x tp mesh (the engine puts its mesh in
    context around its jitted calls, so the kernels run per shard): same greedy tokens as "xla"."""
    from jaxrl.generate import SamplingParams, sample

    mesh = _mesh("generator")
    prompts = [[5, 17, 3, 99, 42, 8, 11], [7]]
    greedy = SamplingParams(max_tokens=3, temperature=0.0)

    def run(impl):
        model = create_model(tiny_model_config(attention_impl=impl, **MODEL), seed=0)
        return sample(model, prompts, greedy, mesh=mesh, num_slots=2, chunk_steps=3)

    got, want = run("pallas"), run("xla")
    assert [c.tokens for c in got] == [c.tokens for c in want]
    np.testing.assert_allclose(
        [c.logprobs for c in got], [c.logprobs for c in want], **TOLERANCES["float32"]
    )


def test_engine_calls_inside_a_callers_jit():
    """`set_mesh` is not allowed inside `jit`: the engine's own mesh context steps aside when it is
    traced by a caller (as the JetStream adapter does), and the caller's context applies."""
    from jaxrl.generate.engine import JaxEngine

    mesh = _mesh("generator")
    model = create_model(tiny_model_config(attention_impl="pallas", **MODEL), seed=0)
    engine = JaxEngine(model, num_slots=4, max_len=16, chunk_steps=2, mesh=mesh)
    state = engine.init_decode_state()
    with engine.mesh_context(state):
        traced = jax.make_jaxpr(engine.generate)(engine.params, state)
    assert "shard_map" in str(traced)  # the kernel runs per shard under the caller's context
    jax.jit(engine.generate)(engine.params, state)  # runs; no set_mesh-inside-jit error
