"""The Tinker-compatible service driven by the official `tinker` SDK against a tiny random model
(one server for the module, so the compiled functions are shared)."""

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
from jaxrl.models import lora
from jaxrl.service.backend import Backend
from jaxrl.service.server import Running, Service


@pytest.fixture(scope="module")
def server():
    running = Running(Service(Backend.load("tiny", max_len=64, num_slots=4)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    # closed before the server stops: an open SDK session keeps a heartbeat thread that logs
    # connection warnings into every later test of the process
    service_client = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    yield service_client
    service_client.close("success").result()


def datum(tokens, weights=None):
    n = len(tokens) - 1
    w = np.ones(n, np.float32) if weights is None else weights
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:]), "weights": w})


DATA_A = [datum(list(range(3, 19))), datum([5, 9, 11, 5, 9, 11, 5, 9, 11, 5])]
DATA_B = [datum([40, 41, 42, 43] * 4)]


def train(tc, data, steps, lr=1e-2):
    losses = []
    for _ in range(steps):
        fb = tc.forward_backward(data, "cross_entropy")
        opt = tc.optim_step(types.AdamParams(learning_rate=lr))
        losses.append(fb.result().metrics["loss:sum"])
        opt.result()
    return losses


def adapters_of(server, tc):
    return jax.tree.map(np.asarray, server.service.backend.models[tc.model_id].adapters)


def test_supervised_lowers_loss_and_sampling_matches_jaxrl_engine(server, client):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    losses = train(tc, DATA_A, 6)
    assert all(x > y for x, y in zip(losses, losses[1:], strict=False)), losses
    assert losses[-1] < 0.95 * losses[0], losses
    # per-datum logprobs come back with the datum's length; loss:sum is their weighted sum
    out = tc.forward(DATA_A, "cross_entropy").result()
    assert [o["logprobs"].shape for o in out.loss_fn_outputs] == [[15], [9]]
    total = -sum(float(np.sum(o["logprobs"].to_numpy())) for o in out.loss_fn_outputs)
    assert out.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)

    sc = tc.save_weights_and_get_sampling_client().result()
    prompt = [3, 4, 5, 6]
    res = sc.sample(types.ModelInput.from_ints(prompt), 3,
                    types.SamplingParams(max_tokens=10, seed=11, temperature=1.0),
                    include_prompt_logprobs=True).result()
    # the same weights through jaxrl's own engine, same engine shape, same seed: bit-equal
    backend = server.service.backend
    snap = backend.snapshots[server.service.samplers[sc._sampling_session_id][0]]
    model = nnx.merge(snap.graphdef, lora.join(backend.base, snap.adapters))
    engine = JaxEngine(model, num_slots=4, max_len=64, eos_ids=backend.eos_ids)
    ref = gen_api.sample(engine, [prompt], SamplingParams(max_tokens=10, seed=11, n=3))
    assert [s.tokens for s in res.sequences] == [c.tokens for c in ref]
    assert [s.logprobs for s in res.sequences] == [c.logprobs for c in ref]
    assert all(s.stop_reason == c.finish_reason for s, c in zip(res.sequences, ref, strict=True))
    # prompt logprobs: None first, then the trained model's log p(prompt[t] | prompt[:t])
    assert res.prompt_logprobs[0] is None and len(res.prompt_logprobs) == len(prompt)
    fwd = tc.forward([datum(prompt)], "cross_entropy").result()
    np.testing.assert_allclose(res.prompt_logprobs[1:],
                               fwd.loss_fn_outputs[0]["logprobs"].to_numpy(), rtol=1e-5)


def test_two_clients_do_not_touch_each_other(server, client):
    alone = client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    losses_alone = train(alone, DATA_B, 4)
    b_alone = adapters_of(server, alone)

    a = client.create_lora_training_client(base_model="tiny", rank=4, seed=3).result()
    b = client.create_lora_training_client(base_model="tiny", rank=4, seed=7).result()
    losses = {"a": [], "b": []}
    for _ in range(4):  # both clients' requests in flight together, interleaved
        fa = a.forward_backward(DATA_A, "cross_entropy")
        fb = b.forward_backward(DATA_B, "cross_entropy")
        oa = a.optim_step(types.AdamParams(learning_rate=1e-2))
        ob = b.optim_step(types.AdamParams(learning_rate=1e-2))
        losses["a"].append(fa.result().metrics["loss:sum"])
        losses["b"].append(fb.result().metrics["loss:sum"])
        oa.result(), ob.result()
    assert losses["a"][-1] < losses["a"][0] and losses["b"][-1] < losses["b"][0], losses
    assert losses["b"] == losses_alone
    b_shared = adapters_of(server, b)
    jax.tree.map(np.testing.assert_array_equal, b_shared, b_alone)


def test_bad_requests_get_sdk_errors_and_the_server_keeps_serving(server, client):
    with pytest.raises(tinker.NotFoundError, match="unknown base model 'nope'"):
        client.create_lora_training_client(base_model="nope", rank=2).result()
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()
    with pytest.raises(tinker.BadRequestError, match="loss_fn 'dro' is not supported"):
        tc.forward_backward(DATA_A, "dro").result()
    bad = datum([3, 4, 5, 6], weights=np.ones(7, np.float32))
    with pytest.raises(tinker.BadRequestError, match=r"'weights' has shape \[7\]; expected \[3\]"):
        tc.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_inputs 'logprobs'"):
        tc.forward_backward(DATA_A, "importance_sampling").result()
    huge = datum(list(range(3, 3 + 80)))
    with pytest.raises(tinker.BadRequestError, match="tokens; need 1..64"):
        tc.forward_backward([huge], "cross_entropy").result()
    out = tc.forward_backward(DATA_A, "cross_entropy").result()  # still serving
    assert np.isfinite(out.metrics["loss:sum"])
