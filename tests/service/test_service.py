"""The Tinker-compatible service driven by the official `tinker` SDK against a tiny random model
(one server for the module, so the compiled functions are shared)."""

from __future__ import annotations

import contextlib
import socket
import time

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


def train(tc, data, steps, lr=5e-3):  # (LoRA alpha 32: 1e-2 at alpha 16 took 6 falling steps)
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
        oa = a.optim_step(types.AdamParams(learning_rate=5e-3))
        ob = b.optim_step(types.AdamParams(learning_rate=5e-3))
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
    with pytest.raises(tinker.BadRequestError, match="stable_reinforce needs provenance"):
        tc.forward_backward(DATA_A, "stable_reinforce").result()
    bad = datum([3, 4, 5, 6], weights=np.ones(7, np.float32))
    with pytest.raises(tinker.BadRequestError, match=r"'weights' has shape \[7\]; expected \[3\]"):
        tc.forward_backward([bad], "cross_entropy").result()
    with pytest.raises(tinker.BadRequestError, match="needs loss_fn_inputs 'logprobs'"):
        tc.forward_backward(DATA_A, "importance_sampling").result()
    masked = datum([3, 4, 5, 6])  # an input no loss reads (a per-datum clip threshold too)
    masked.loss_fn_inputs["mask"] = types.TensorData.from_numpy(np.ones(3, np.float32))
    with pytest.raises(tinker.BadRequestError, match=r"loss_fn_inputs \['mask'\] are not read "
                       "by cross_entropy; it reads target_tokens, weights"):
        tc.forward_backward([masked], "cross_entropy").result()
    huge = datum(list(range(3, 3 + 80)))
    with pytest.raises(tinker.BadRequestError, match="tokens; need 1..64"):
        tc.forward_backward([huge], "cross_entropy").result()
    out = tc.forward_backward(DATA_A, "cross_entropy").result()  # still serving
    assert np.isfinite(out.metrics["loss:sum"])


# ------------------------------------------------------------------ limits, fairness, cancel


def _post(http, server, route, body, key="tml-local"):
    return http.post(f"{server.url}/api/v1/{route}", headers={"X-API-Key": key},
                     **({"content": body} if isinstance(body, bytes) else {"json": body}))


def _sample_body(tokens, n=1, **sp):
    return {"base_model": "tiny", "num_samples": n, "sampling_params": sp,
            "prompt": {"chunks": [{"type": "encoded_text", "tokens": tokens}]}}


def test_requests_over_a_limit_are_refused_at_once_naming_it(server):
    """Issue 47 defect 6: each oversized request -> 400 naming the limit and the value, in under
    100 ms, and nothing queued for the model. Limits: the module server's defaults (max_len 64
    from `Backend.load`, `Limits()`: 256 samples, rank 128, 32 MiB bodies)."""
    import httpx

    futures = len(server.service.futures)
    cases = [
        ("asample", _sample_body([3, 4, 5], n=10**6),
         "num_samples 1000000 exceeds the server's limit of 256"),
        ("asample", _sample_body([3, 4, 5], max_tokens=10**9),
         "max_tokens 1000000000 = 1000000003 exceeds the server's max_len 64"),
        ("asample", _sample_body(list(range(3, 3 + 64))),
         "prompt of 64 tokens; this server takes 1 to 63"),
        ("create_model", {"base_model": "tiny", "lora_config": {"rank": 10**9}},
         "lora rank 1000000000 exceeds the server's limit of 128"),
        ("asample", b"[1, 2, 3]", "must be a JSON object, got a JSON array"),
        ("create_model", b'"tiny"', "must be a JSON object, got a JSON string"),
        ("retrieve_future", b"{not json", "is not valid JSON"),
    ]
    with httpx.Client(timeout=30) as http:
        _post(http, server, "create_session", {})  # a warm connection
        for route, body, message in cases:
            start = time.perf_counter()
            r = _post(http, server, route, body)
            took = time.perf_counter() - start
            assert r.status_code == 400 and message in r.json()["error"], (route, r.text)
            assert took < 0.1, (route, message, took)
    # a 200 MB body: refused from its Content-Length, before the body is read
    host, port = server.url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=30) as sock:
        start = time.perf_counter()
        sock.sendall(f"POST /api/v1/asample HTTP/1.1\r\nHost: {host}\r\nX-API-Key: tml-local\r\n"
                     f"Content-Type: application/json\r\nContent-Length: {200 * 2**20}\r\n\r\n"
                     '{"prompt": [1, 2'.encode())
        head = sock.recv(65536).decode()
        took = time.perf_counter() - start
    assert head.startswith("HTTP/1.1 400"), head
    assert f"request body of {200 * 2**20} bytes exceeds the server's limit of {32 * 2**20} " \
           "bytes" in head
    assert took < 0.1, took
    assert idle(server) and len(server.service.futures) == futures


def idle(server):
    return all(f.done() for f, *_ in server.service.futures.values())


def _wait(condition, what, timeout=60):
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.005)


@contextlib.contextmanager
def slow_decode(server, seconds):
    """Every decode chunk of the base model's engine sleeps `seconds` (`JaxEngine.debug_delay_s`):
    a long request stays long on a fast machine (its 256 chunks take >= 256 x `seconds`)."""
    engine = server.service.backend.engine(None)  # the worker is idle: no run uses it now
    engine.debug_delay_s = seconds
    try:
        yield
    finally:
        engine.debug_delay_s = 0.0


def test_a_second_keys_request_is_served_during_a_long_one_which_can_be_cancelled(server):
    """Issue 47 defect 6: one key's long sampling request (256 samples to the KV cache's end,
    256 decode chunks of >= 50 ms) does not hold back another key's small one (answered within
    2 s while the long one still runs), and it stops when cancelled (Tinker's `cancel_future`)."""
    import httpx

    other = tinker.ServiceClient(base_url=server.url, api_key="tml-other-key")
    try:
        sc = other.create_sampling_client(base_model="tiny").result()
        prompt, small = types.ModelInput.from_ints([3, 4, 5]), types.SamplingParams(max_tokens=8)
        sc.sample(prompt, 1, small).result()  # compiles the base model's engine
        with httpx.Client(timeout=30) as http, slow_decode(server, 0.05):
            r = _post(http, server, "asample",
                      _sample_body([3, 4, 5], n=256, max_tokens=61, stop=[], seed=0))
            long_id = r.json()["request_id"]
            long_job = server.service.futures[long_id][0]
            _wait(long_job.running, "the long request to start")
            start = time.perf_counter()
            res = sc.sample(prompt, 1, small).result()
            took = time.perf_counter() - start
            assert len(res.sequences) == 1 and 1 <= len(res.sequences[0].tokens) <= 8
            assert took < 2, took
            assert not long_job.done(), "the long request ended first: make it longer"

            assert _post(http, server, "cancel_future", {"request_id": long_id}).json() is None
            out = _post(http, server, "retrieve_future", {"request_id": long_id}).json()
            assert out["category"] == "user" and "was cancelled" in out["error"], out
            _wait(lambda: idle(server), "the worker to drop the cancelled request", 5)
            r = _post(http, server, "cancel_future", {"request_id": "req-nope-1"})
            assert r.status_code == 404 and "unknown request_id" in r.json()["error"]
    finally:
        other.close("success").result()


def test_the_sdk_cancels_a_sampling_future_it_abandons(server):
    """The SDK sends `cancel_future` for a sampling future cancelled locally, since the server's
    dynamic config enables it; the server then stops the work."""
    sdk = tinker.ServiceClient(base_url=server.url, api_key="tml-sdk-cancel")
    try:
        sc = sdk.create_sampling_client(base_model="tiny").result()
        with slow_decode(server, 0.1):  # the request alone would take >= 25.6 s
            fut = sc.sample(types.ModelInput.from_ints([3, 4, 5]), 256,
                            types.SamplingParams(max_tokens=61, stop=[], seed=1))
            _wait(lambda: any(f.running() for f, *_ in server.service.futures.values()),
                  "the request to start")
            # the SDK sends cancel_future only for a future it polls: give it its request id
            time.sleep(1.0)
            fut.future().cancel()
            _wait(lambda: idle(server), "the server to stop the abandoned request", 8)
    finally:
        sdk.close("success").result()


def test_each_request_is_one_log_line_refusals_and_failures_at_warning(server, caplog,
                                                                        monkeypatch):
    """Issue 48 items 5 and 6: every request is one line (method, route, the key's owner id,
    never the key, status, duration): a success at info level, a refusal on arrival at warning
    level with its reason, an unknown route a 404 that says so; an accepted request that fails
    is one more line, an error naming its route."""
    import re

    import httpx

    from jaxrl.service.server import owner_of

    def broken(*args):
        raise RuntimeError("disk on fire")

    caplog.set_level("INFO", logger="jaxrl.service")
    with httpx.Client(timeout=30) as http:
        r = _post(http, server, "asample", _sample_body([3, 4, 5], n=10**6), key="tml-logged")
        assert r.status_code == 400
        r = _post(http, server, "no_such_route", {}, key="tml-logged")
        assert r.status_code == 404
        assert r.json()["error"] == ("Not Found: this server has no route POST "
                                     "/api/v1/no_such_route")
        tc_id = _post(http, server, "create_model", {"base_model": "tiny", "lora_config": {
            "rank": 2, "seed": 0}}, key="tml-logged").json()["request_id"]
        model_id = _post(http, server, "retrieve_future", {"request_id": tc_id},
                         key="tml-logged").json()["model_id"]
        monkeypatch.setattr(server.service.backend, "optim_step", broken)
        rid = _post(http, server, "optim_step", {"model_id": model_id, "adam_params": {
            "learning_rate": 1e-3}}, key="tml-logged").json()["request_id"]
        out = _post(http, server, "retrieve_future", {"request_id": rid}, key="tml-logged")
        assert out.json()["category"] == "server"
    owner = owner_of("tml-logged")
    lines = [(r.levelname, r.getMessage()) for r in caplog.records if owner in r.getMessage()]
    ms = r"\d+\.\d ms"
    expected = [
        ("WARNING", rf"refused POST /api/v1/asample \({owner}, HTTP 400, {ms}\): sample: "
                    "num_samples 1000000 exceeds the server's limit of 256 "
                    r"\(--max-num-samples\)"),
        ("WARNING", rf"refused POST /api/v1/no_such_route \({owner}, HTTP 404, {ms}\): Not "
                    "Found: this server has no route POST /api/v1/no_such_route"),
        ("INFO", rf"POST /api/v1/create_model \({owner}, HTTP 200, {ms}\)"),
        ("INFO", rf"POST /api/v1/retrieve_future \({owner}, HTTP 200, {ms}\)"),
        ("INFO", rf"POST /api/v1/optim_step \({owner}, HTTP 200, {ms}\)"),
        ("ERROR", rf"failed POST /api/v1/optim_step {rid} \({owner}\): RuntimeError: disk on "
                  "fire"),
        ("INFO", rf"POST /api/v1/retrieve_future \({owner}, HTTP 200, {ms}\)")]
    # the failure's line comes from the worker thread, before or after the poll's: by level
    by_level = lambda pairs: pairs[:4] + sorted(pairs[4:], key=lambda pair: pair[0])
    assert len(lines) == len(expected), lines
    for (level, message), (want_level, pattern) in zip(by_level(lines), by_level(expected),
                                                      strict=True):
        assert level == want_level and re.fullmatch(pattern, message), (level, message)
    assert not any("tml-logged" in r.getMessage() for r in caplog.records)


def test_options_are_done_or_refused_never_ignored(client):
    """Issue 48 item 2: `save_state(overwrite=False)` refuses an existing name,
    `kind="inflight"` sampling clients follow the client's latest inflight save,
    `prompt_logprobs_last_n` scores only the prompt's last N tokens, and
    `record_stability_info` is recorded (tests/service/test_stable_reinforce.py)."""
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=5).result()
    first = tc.save_state("ckpt").result().path
    with pytest.raises(tinker.BadRequestError, match=f"{first} exists; pass overwrite=True"):
        tc.save_state("ckpt").result()
    assert tc.save_state("ckpt", overwrite=True).result().path == first

    prompt = types.ModelInput.from_ints([3, 4, 5, 6, 7])
    greedy = types.SamplingParams(max_tokens=2, temperature=0.0)

    def prompt_lp(sc, **kw):
        return sc.sample(prompt, 1, greedy, include_prompt_logprobs=True, **kw
                         ).result().prompt_logprobs

    inflight_a = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    w1 = tc.save_weights_and_get_sampling_client().result()  # a snapshot of the same weights
    assert prompt_lp(inflight_a) == prompt_lp(w1)
    train(tc, DATA_A, 1)
    inflight_b = tc.save_weights_and_get_sampling_client(kind="inflight").result()
    assert prompt_lp(inflight_a) == prompt_lp(inflight_b) != prompt_lp(w1)  # both on W2

    full = prompt_lp(w1)
    assert prompt_lp(w1, prompt_logprobs_last_n=2) == [None, None, None, *full[3:]]
    with pytest.raises(tinker.BadRequestError, match=r"in 1..len\(prompt\) - 1 = 4, got 5"):
        prompt_lp(w1, prompt_logprobs_last_n=5)
    stable = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    assert stable.sample(prompt, 1, greedy).result().sequences[0].sequence_id.startswith("seq-")


def test_gspo_and_dro_through_the_sdk_equal_their_definitions_on_the_returned_logprobs(client):
    """Issue 48 item 1: `forward(..., "gspo" / "dro")` sums each loss over the datum's tokens,
    computed here in numpy from the logprobs the server returns (mask, config and defaults as
    sent)."""
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=9).result()
    tokens = list(range(3, 12))
    n = len(tokens) - 1
    rng = np.random.default_rng(0)
    q = rng.uniform(-5, -1, n).astype(np.float32)
    adv = np.where(np.arange(n) < 3, 0.0, rng.uniform(-1, 1, n)).astype(np.float32)
    mask = (np.arange(n) >= 3).astype(np.float32)

    def forward(loss, config=None, **extra):
        d = types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]), loss_fn_inputs={
            "target_tokens": np.array(tokens[1:]), "logprobs": q, "advantages": adv, **extra})
        out = tc.forward([d], loss, loss_fn_config=config).result()
        return out.loss_fn_outputs[0]["logprobs"].to_numpy(), out.metrics["loss:sum"]

    lp, total = forward("dro", {"beta": 0.1})
    assert total == pytest.approx(float(np.sum(-(lp * adv - 0.05 * (lp - q) ** 2))), rel=1e-5)
    for extra in ({"sequence_ratio_mask": mask}, {}):  # unsent: the tokens with A != 0
        lp, total = forward("gspo", {"clip_low_threshold": 0.5, "clip_high_threshold": 2.0},
                            **extra)
        s = np.exp(np.sum((lp - q) * mask) / mask.sum())
        want = -np.minimum(s * adv, np.clip(s, 0.5, 2.0) * adv)
        assert total == pytest.approx(float(np.sum(want)), rel=1e-5)
