"""Saved weights and sampling sessions survive a server restart; a request accepted before the
restart fails in the way the SDK retries (HTTP 410 -> RetryableException); the retry succeeds."""

from __future__ import annotations

import threading
import time

import jax
import numpy as np
import pytest
import tinker
from tinker import types

from jaxrl.service.backend import Backend
from jaxrl.service.server import Running, Service
from jaxrl.service.store import atomic_write


def _server(state_dir, port=0):
    return Running(Service(Backend.load("tiny", max_len=64, num_slots=4, state_dir=state_dir)),
                   port=port)


def _datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:])})


DATA = [_datum(list(range(3, 19)))]
PROMPT = types.ModelInput.from_ints([3, 4, 5, 6])
PARAMS = types.SamplingParams(max_tokens=8, seed=5, temperature=1.0)


def test_atomic_write_replaces_whole_and_leaves_no_temporaries(tmp_path):
    target = tmp_path / "d" / "f.bin"
    atomic_write(target, b"old")
    atomic_write(target, b"new")
    assert target.read_bytes() == b"new"
    assert [p.name for p in target.parent.iterdir()] == ["f.bin"]


def test_saves_survive_a_restart_and_an_inflight_sample_is_retried(tmp_path):
    first = _server(tmp_path)
    port = int(first.url.rsplit(":", 1)[1])
    client = tinker.ServiceClient(base_url=first.url, api_key="tml-local")
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    tc.forward_backward(DATA, "cross_entropy")
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
    state_path = tc.save_state("ckpt").result().path
    before = jax.tree.map(np.asarray, first.service.backend.models[tc.model_id].adapters)
    sc = tc.save_weights_and_get_sampling_client().result()
    expected = sc.sample(PROMPT, 2, PARAMS).result()

    # a sample accepted but not run (the worker is held) when the server goes down
    release = threading.Event()
    first.service.worker.submit(release.wait)
    accepted = len(first.service.futures)
    pending = sc.sample(PROMPT, 2, PARAMS)
    deadline = time.time() + 30
    while len(first.service.futures) == accepted and time.time() < deadline:
        time.sleep(0.05)
    assert len(first.service.futures) == accepted + 1, "the sample was never accepted"
    first.stop()
    release.set()

    second = _server(tmp_path, port)  # same state dir and port: a restarted server
    try:
        # the SDK got 410 for the lost request, raised RetryableException, and sent it again
        got = pending.result(timeout=120)
        assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
        assert [s.logprobs for s in got.sequences] == [s.logprobs for s in expected.sequences]

        with pytest.raises(tinker.NotFoundError, match="do not survive a server restart"):
            tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()
        again = client.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
        again.load_state_with_optimizer(state_path).result()
        after = jax.tree.map(np.asarray, second.service.backend.models[again.model_id].adapters)
        jax.tree.map(np.testing.assert_array_equal, after, before)
        assert second.service.backend.models[again.model_id].steps == 1
        assert not list(tmp_path.rglob("*.tmp"))
    finally:
        client.close("success").result()  # its heartbeat thread would log into later tests
        second.stop()
