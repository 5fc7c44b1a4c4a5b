"""Per-client credentials: with keys set, each key owns what it creates, and another key can
neither read nor change it (the SDK's NotFoundError, as for something that does not exist)."""

from __future__ import annotations

import asyncio

import jax
import numpy as np
import pytest
import tinker
from tinker import types
from tinker._client import AsyncTinker  # the SDK's low-level REST client

from jaxrl.service.backend import Backend
from jaxrl.service.server import Running, Service

ALICE, BOB = "tml-alice-key", "tml-bob-key"


def datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:])})


def raw(url, key, call):
    """One request through the SDK's low-level REST client (what a forged client would send)."""

    async def go():
        async with AsyncTinker(base_url=url, api_key=key, max_retries=0) as c:
            return await call(c)

    return asyncio.run(go())


@pytest.mark.slow  # ~75 s on 2 shared vCPUs (compiles the tiny model's train and sample steps)
def test_one_key_cannot_read_or_change_anothers_weights(tmp_path):
    running = Running(Service(Backend.load("tiny", max_len=64, num_slots=4, state_dir=tmp_path),
                              api_keys=[ALICE, BOB]))
    a = tinker.ServiceClient(base_url=running.url, api_key=ALICE)
    b = tinker.ServiceClient(base_url=running.url, api_key=BOB)
    try:
        ta = a.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        ta.forward_backward([datum(list(range(3, 19)))], "cross_entropy").result()
        ta.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        state = ta.save_state("a-state").result().path
        weights = ta.save_weights_for_sampler("a-weights").result().path
        sc_a = ta.save_weights_and_get_sampling_client().result()
        a_request = next(reversed(running.service.futures))  # a future of A's
        model = running.service.backend.models[ta.model_id]
        before = jax.tree.map(np.array, model.adapters)
        prompt = types.ModelInput.from_ints([3, 4, 5])
        params = types.SamplingParams(max_tokens=4, seed=1)

        tb = b.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        with pytest.raises(tinker.NotFoundError, match="unknown weights path"):
            tb.load_state(state).result()
        with pytest.raises(tinker.NotFoundError, match="unknown weights path"):
            b.create_sampling_client(model_path=weights).result().sample(
                prompt, 1, params).result()
        with pytest.raises(tinker.NotFoundError, match="unknown sampler"):
            raw(running.url, BOB, lambda c: c.sampling.asample(request=types.SampleRequest(
                sampling_session_id=sc_a._sampling_session_id, prompt=prompt,
                sampling_params=params)))
        # requests naming A's model id, sent with B's key
        adam = types.AdamParams(learning_rate=1.0)
        forged = {
            "optim_step": lambda c: c.training.optim_step(request=types.OptimStepRequest(
                model_id=ta.model_id, adam_params=adam)),
            "save over": lambda c: c.weights.save(request=types.SaveWeightsRequest(
                model_id=ta.model_id, path="a-state")),
            "load into": lambda c: c.weights.load(request=types.LoadWeightsRequest(
                model_id=ta.model_id, path=state, optimizer=True)),
            "retrieve": lambda c: c.futures.retrieve(request=types.FutureRetrieveRequest(
                request_id=a_request)),
        }
        for what, call in forged.items():
            with pytest.raises(tinker.NotFoundError, match="unknown"):
                raw(running.url, BOB, call)
            assert what  # (named for the failure report)
        # the model-id listing in B's errors shows B's models only
        with pytest.raises(tinker.NotFoundError) as e:
            raw(running.url, BOB, forged["optim_step"])
        assert tb.model_id in str(e.value) and ta.model_id not in str(e.value).split(";")[1]
        with pytest.raises(tinker.AuthenticationError):
            raw(running.url, "tml-nobody", forged["optim_step"])

        jax.tree.map(np.testing.assert_array_equal, model.adapters, before)
        # A still reaches all of it
        ta.load_state(state).result()
        assert len(sc_a.sample(prompt, 1, params).result().sequences[0].tokens) == 4
    finally:
        a.close("success").result()
        b.close("success").result()
        running.stop()
