"""Decoding different LoRA adapters in one batch (`MultiLoraEngine`, issue 26 item 2) against
each adapter alone: the reference folds the adapter into the base weights (`lora.merge`) and
decodes with a plain `JaxEngine`, so it shares no LoRA code with the batched path."""

from __future__ import annotations

import dataclasses
import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from jaxrl.config import LoraConfig
from jaxrl.generate import api as gen_api
from jaxrl.generate.engine import JaxEngine
from jaxrl.generate.multi_lora import MultiLoraEngine
from jaxrl.generate.sampling import SamplingParams
from jaxrl.generate.scheduler import Scheduler
from jaxrl.models import lora
from jaxrl.models.model import abstract_model
from jaxrl.models.transformer import Transformer
from jaxrl.presets import tiny_model_config

# merged weights x(W + sAB) vs. x W + s(x A)B: equal up to f32 rounding
LOGP_ATOL = 1e-4
LORA = LoraConfig(rank=4, targets=("q", "k", "v", "o", "gate", "up", "down"))


def _random_adapters(adapters: dict, seed: int) -> dict:
    """Adapters that change the model (B starts at zero): every leaf redrawn, scaled so each
    adapter decodes differently from the others (numpy: no compile per shape)."""
    rng = np.random.default_rng(seed)
    return jax.tree.map(lambda x: jnp.asarray(0.4 * rng.standard_normal(x.shape), x.dtype),
                        adapters)


@pytest.mark.slow  # 31 s on the shared 2 vCPUs at load 6.8 (compiles of two engines)
def test_three_adapters_in_one_batch_equal_each_alone():
    cfg = dataclasses.replace(tiny_model_config(), lora=LORA)
    init = jax.jit(lambda: nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0)))))
    base, adapters0 = lora.split(init())
    adapters = [_random_adapters(adapters0, s) for s in range(3)]
    graphdef = nnx.split(abstract_model(cfg))[0]
    engine = MultiLoraEngine(nnx.merge(graphdef, lora.join(base, adapters[0])), max_adapters=4,
                             num_slots=4, max_len=32, chunk_steps=4)
    engine.set_adapters(base, adapters)
    requests = [([5, 9, 11, 5, 9], 2, SamplingParams(max_tokens=10, temperature=0.0, n=2)),
                ([40, 41, 42], 0, SamplingParams(max_tokens=12, temperature=0.0)),
                ([7, 3, 7, 3, 7, 3, 1], 1, SamplingParams(max_tokens=9, temperature=0.0, n=2)),
                ([5, 9, 11, 5, 9], 0, SamplingParams(max_tokens=10, temperature=1.0, seed=3))]
    scheduler = Scheduler(engine)  # 6 samples on 4 slots: refills mix adapters across chunks
    ids = [scheduler.submit(p, sp, adapter=a) for p, a, sp in requests]
    done = {(c.request_id, c.sample_index): c for c in scheduler.run()}
    assert len(done) == 6

    plain_graphdef = nnx.split(abstract_model(tiny_model_config()))[0]
    merge = jax.jit(lambda a: lora.merge(lora.join(base, a), LORA))
    merged = [nnx.merge(plain_graphdef, merge(a)) for a in adapters]
    solo = JaxEngine(merged[0], num_slots=4, max_len=32, chunk_steps=4)
    for rid, (prompt, a, sp) in zip(ids, requests, strict=True):
        solo.set_params(merged[a], 0)
        for ref in gen_api.sample(solo, [prompt], sp):
            got = done[rid, ref.sample_index]
            assert got.tokens == ref.tokens, (rid, a)
            np.testing.assert_allclose(got.logprobs, ref.logprobs, atol=LOGP_ATOL)
            assert got.finish_reason == ref.finish_reason
    # the adapters matter: request 0's prompt decodes differently under adapter 0 than 2
    solo.set_params(merged[0], 0)
    other = gen_api.sample(solo, [requests[0][0]], requests[0][2])[0]
    assert other.tokens != done[ids[0], 0].tokens

    with pytest.raises(ValueError, match=r"adapter index 4 outside \[0, 4\)"):
        scheduler.submit([5], SamplingParams(), adapter=4)
    with pytest.raises(ValueError, match="1 to 4"):
        engine.set_adapters(base, adapters * 2)


@pytest.mark.slow
def test_two_sdk_sampling_clients_are_decoded_in_one_batch():
    """Two sampling clients' requests queued together run in one scheduler run of the backend,
    each getting the tokens (and, to f32 tolerance, the log-probabilities) it gets alone."""
    import tinker
    from tinker import types

    from jaxrl.service.backend import Backend
    from jaxrl.service.server import Running, Service

    backend = Backend.load("tiny", max_len=48, num_slots=4)
    running = Running(Service(backend))
    client = tinker.ServiceClient(base_url=running.url, api_key="tml-local")
    worker = running.service.worker
    try:
        samplers = []
        for seed in (1, 2):
            tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=seed).result()
            m = backend.models[tc.model_id]
            m.adapters = _random_adapters(m.adapters, seed)  # B = 0 would equal the base
            samplers.append(tc.save_weights_and_get_sampling_client(f"s{seed}").result())
        prompt = types.ModelInput.from_ints([5, 9, 11, 5, 9])
        params = types.SamplingParams(max_tokens=8, temperature=0.0, seed=0)

        def sample_all():
            gate = threading.Event()
            worker.submit(gate.wait)  # hold the worker until both requests are queued
            futures = [sc.sample(prompt, 2, params) for sc in samplers]
            deadline = time.monotonic() + 30
            while len(worker._queue) < len(samplers) and time.monotonic() < deadline:
                time.sleep(0.01)
            gate.set()
            return [f.result().sequences for f in futures]

        runs, served = backend.sample_runs, backend.sampled_requests
        together = sample_all()
        assert (backend.sample_runs - runs, backend.sampled_requests - served) == (1, 2)
        alone = [sc.sample(prompt, 2, params).result().sequences for sc in samplers]
        assert backend.sample_runs - runs == 3
        assert together[0][0].tokens != together[1][0].tokens  # different adapters
        for got, ref in zip(together, alone, strict=True):
            for g, r in zip(got, ref, strict=True):
                assert g.tokens == r.tokens
                np.testing.assert_allclose(g.logprobs, r.logprobs, atol=LOGP_ATOL)
    finally:
        client.close("success").result()
        running.stop()
