"""`--full-params`: the SDK's LoRA request trains every base parameter (the protocol has no
full-parameter request); the shared base stays as it was; samples come from the trained copy."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tinker
from flax import nnx
from tinker import types

from jaxrl.generate import api as gen_api
from jaxrl.generate.engine import JaxEngine
from jaxrl.generate.sampling import SamplingParams
from jaxrl.service.backend import Backend
from jaxrl.service.server import Running, Service


@pytest.mark.slow  # ~80 s on 2 shared vCPUs (compiles the full-model train and sample steps)
def test_full_params_trains_every_parameter_and_samples_from_them():
    backend = Backend.load("tiny", max_len=64, num_slots=2)
    base = jax.tree.map(np.array, backend.base)
    running = Running(Service(backend, full_params=True))
    client = tinker.ServiceClient(base_url=running.url, api_key="tml-local")
    try:
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
        assert tc.get_info().is_lora is False
        tokens = list(range(3, 19))
        data = [types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                            loss_fn_inputs={"target_tokens": np.array(tokens[1:])})]
        losses = []
        for _ in range(3):
            fb = tc.forward_backward(data, "cross_entropy")
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            losses.append(fb.result().metrics["loss:sum"])
        assert losses[2] < losses[1] < losses[0], losses
        trained = jax.tree.map(np.array, backend.models[tc.model_id].adapters)
        # every leaf of the model moved (embedding, norms, projections), the base did not
        assert jax.tree.structure(trained) == jax.tree.structure(base)
        moved = jax.tree.leaves(jax.tree.map(lambda a, b: bool(np.any(a != b)), trained, base))
        assert all(moved), f"{moved.count(False)} of {len(moved)} leaves unchanged"
        jax.tree.map(np.testing.assert_array_equal, backend.base, base)

        sc = tc.save_weights_and_get_sampling_client().result()
        res = sc.sample(types.ModelInput.from_ints([3, 4, 5]), 2,
                        types.SamplingParams(max_tokens=6, seed=5)).result()
        engine = JaxEngine(nnx.merge(backend.base_graphdef, trained), num_slots=2, max_len=64,
                           eos_ids=backend.eos_ids)
        ref = gen_api.sample(engine, [[3, 4, 5]], SamplingParams(max_tokens=6, seed=5, n=2))
        assert [s.tokens for s in res.sequences] == [c.tokens for c in ref]
    finally:
        client.close("success").result()
        running.stop()


def test_full_params_serves_one_owner_only():
    with pytest.raises(ValueError, match="single owner; got 2 API keys"):
        Service(object.__new__(Backend), api_keys=["tml-a", "tml-b"], full_params=True)
