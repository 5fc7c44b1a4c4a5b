"""A scheduler frees its KV cache and its engine's weights while idle, and comes back exactly."""

import jax
import pytest
from flax import nnx

from jaxrl.generate import JaxEngine, SamplingParams, Scheduler
from jaxrl.models import create_model
from jaxrl.models.model import abstract_model
from jaxrl.testing import tiny_model_config

SP = SamplingParams(max_tokens=6, temperature=1.0, top_k=20, n=2, seed=11)
PROMPTS = [[1, 2, 3], [9] * 7, list(range(30, 40))]


def _live_bytes() -> int:
    return sum(x.nbytes for x in jax.live_arrays() if not x.is_deleted())


def _run(sched):
    for p in PROMPTS:
        sched.submit(p, SP)
    done = sorted(sched.run(), key=lambda c: (c.request_id, c.sample_index))
    return [(c.sample_index, c.tokens, c.logprobs) for c in done]


def test_release_frees_cache_and_weights_and_generation_resumes_identically():
    model = create_model(tiny_model_config(), seed=3)
    state = nnx.state(model)
    engine = JaxEngine(model, num_slots=4, max_len=64, chunk_steps=4, max_stop_ids=4)
    del model
    sched = Scheduler(engine)
    first = _run(sched)
    cache_bytes = sum(x.nbytes for x in jax.tree.leaves(sched.state.cache))
    weight_bytes = sum(x.nbytes for x in jax.tree.leaves(engine.params.state))
    state = jax.tree.map(lambda x: x.copy(), state)  # ours, not the engine's arrays
    before = _live_bytes()

    sched.release()
    assert sched.state is None and engine.params is None
    assert before - _live_bytes() >= cache_bytes + weight_bytes
    sched.submit(PROMPTS[0], SP)
    with pytest.raises(RuntimeError, match="weights were released; set_params first"):
        sched.step()
    sched._queue.clear()
    with pytest.raises(ValueError, match=r"set_params: .*embed"):  # still checked after release
        engine.set_params(nnx.state(abstract_model(tiny_model_config(hidden_size=32))), 1)

    engine.set_params(state, version=0)
    assert _run(sched) == first


def test_release_refuses_while_samples_run():
    engine = JaxEngine(create_model(tiny_model_config(), seed=3), num_slots=2, max_len=32,
                       chunk_steps=2, max_stop_ids=4)
    sched = Scheduler(engine)
    sched.submit([1, 2, 3], SamplingParams(max_tokens=8, n=3, seed=1))
    sched.step()
    with pytest.raises(RuntimeError, match="2 samples running and 1 waiting"):
        sched.release()
    assert sched.state is not None and engine.params is not None
