"""The service's RestClient side (training runs, checkpoints, TTLs, deletion, publishing, external
weights, copies), its SDK probe (every public method of the four SDK clients works or is refused,
naming what), and a new LoRA client's cost, driven by the official `tinker` SDK against a tiny
random model with a state directory (one server for the module)."""

from __future__ import annotations

import json
import os
import time
import urllib.error
import urllib.request

import jax
import numpy as np
import pytest
import tinker

from jaxrl.models.safetensors_io import read_safetensors
from jaxrl.service.backend import Backend, lora_config
from jaxrl.service.server import Running, Service

ALICE, BOB = "tml-alice", "tml-bob"

_COMPILES: list[int] = []  # one entry per XLA compilation while a test listens (see below)


def _count_compile(event: str, duration: float, **_kw) -> None:
    if _COMPILES and event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    running = Running(Service(Backend.load("tiny", max_len=64, num_slots=4, state_dir=state),
                              api_keys=[ALICE, BOB]))
    running.state = state
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    service_client = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
    yield service_client
    service_client.close("success").result()


@pytest.fixture(scope="module")
def bob(server):
    service_client = tinker.ServiceClient(base_url=server.url, api_key=BOB)
    yield service_client
    service_client.close("success").result()


@pytest.fixture(scope="module")
def trained(client):
    """A rank-4 client of Alice's after one step."""
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([3, 4, 5, 6]),
                               loss_fn_inputs={"target_tokens": [4, 5, 6, 7]})
    tc.forward_backward([datum], "cross_entropy").result()
    tc.optim_step(tinker.types.AdamParams(learning_rate=1e-2)).result()
    return tc


def _file(server, path: str, suffix: str = ".npz"):
    run, kind, name = path.removeprefix("tinker://").split("/")
    return server.state / "weights" / run / kind / (name + suffix)


def test_a_second_lora_client_of_a_layout_compiles_nothing(server, client):
    """Issue 48.4: the adapters' init was jitted as a fresh `functools.partial` per seed, so
    every client recompiled it (3.4-5.8 s on the tiny model)."""
    client.create_lora_training_client(base_model="tiny", rank=4, seed=1).result()  # layout's first
    _COMPILES[:] = [0]
    try:
        t0 = time.perf_counter()
        tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=2).result()
        sdk_s = time.perf_counter() - t0
        t0 = time.perf_counter()
        server.service.backend.create(lora_config(4), seed=3)
        backend_s = time.perf_counter() - t0
        compiles = _COMPILES[0]
    finally:
        _COMPILES.clear()
    assert compiles == 0, f"{compiles} compilations for a LoRA client of a layout met before"
    assert backend_s <= 0.5, f"Backend.create took {backend_s:.2f} s"
    assert sdk_s <= 2.0, f"create_lora_training_client took {sdk_s:.2f} s through the SDK"
    assert tc.get_info().lora_rank == 4


def test_runs_and_checkpoints_listed_got_by_path_and_deleted_freeing_disk(server, client,
                                                                          trained):
    rest = client.create_rest_client()
    state = trained.save_state("a", user_metadata={"step": "1"}).result().path
    sampler = trained.save_weights_for_sampler("s", ttl_seconds=7200).result().path
    t_saved = time.time()
    listed = rest.list_checkpoints(trained.model_id).result().checkpoints
    assert [(c.checkpoint_id, c.checkpoint_type, c.tinker_path) for c in listed] == [
        ("weights/a", "training", state), ("sampler_weights/s", "sampler", sampler)]
    assert [c.size_bytes for c in listed] == [os.path.getsize(_file(server, p))
                                              for p in (state, sampler)]
    assert listed[0].user_metadata == {"step": "1"} and listed[0].expires_at is None
    assert abs(listed[1].expires_at.timestamp() - (t_saved + 7200)) < 60
    run = rest.get_training_run_by_tinker_path(state).result()
    assert (run.training_run_id, run.is_lora, run.lora_rank) == (trained.model_id, True, 4)
    assert run.last_checkpoint.tinker_path == state
    assert run.last_sampler_checkpoint.tinker_path == sampler
    assert rest.get_training_run(trained.model_id).result().training_run_id == trained.model_id
    tagged = client.create_lora_training_client(base_model="tiny", rank=4,
                                                user_metadata={"exp": "probe"}).result()
    assert rest.get_training_run(tagged.model_id).result().user_metadata == {"exp": "probe"}
    runs = rest.list_training_runs(limit=100).result()
    assert trained.model_id in [r.training_run_id for r in runs.training_runs]
    assert runs.cursor.total_count == len(runs.training_runs)
    assert state in [c.tinker_path for c in rest.list_user_checkpoints().result().checkpoints]

    rest.delete_checkpoint_from_tinker_path(state).result()
    assert not _file(server, state).exists() and not _file(server, state, ".json").exists()
    assert [c.tinker_path for c in rest.list_checkpoints(trained.model_id).result()
            .checkpoints] == [sampler]
    with pytest.raises(tinker.NotFoundError, match="unknown weights path .*a'"):
        trained.load_state(state).result()
    with pytest.raises(tinker.NotFoundError, match="no checkpoint weights/a in training run"):
        rest.delete_checkpoint_from_tinker_path(state).result()
    with pytest.raises(tinker.NotFoundError, match="unknown training run 'run-nope'"):
        rest.get_training_run("run-nope").result()


def test_a_checkpoint_past_its_ttl_is_deleted_from_disk(server, client, trained):
    rest = client.create_rest_client()
    path = trained.save_state("short", ttl_seconds=3600).result().path
    assert _file(server, path).exists()
    rest.set_checkpoint_ttl_from_tinker_path(path, None).result()  # never expires
    assert server.service.backend.checkpoints.info(path)["expires_at"] is None
    rest.set_checkpoint_ttl_from_tinker_path(path, 3600).result()
    # an hour passes: the record's expiry moved into the past (the clock is not mocked)
    server.service.backend.checkpoints.update(path, expires_at=time.time() - 1)
    assert path not in [c.tinker_path for c in rest.list_checkpoints(trained.model_id).result()
                        .checkpoints]
    assert not _file(server, path).exists()
    with pytest.raises(tinker.NotFoundError, match="unknown weights path"):
        client.create_sampling_client(model_path=path).result()
    later = trained.save_state("swept", ttl_seconds=3600).result().path
    server.service.backend.checkpoints.update(later, expires_at=time.time() - 1)
    assert later in server.service.backend.checkpoints.sweep()
    assert not _file(server, later).exists()


def test_external_weights_are_a_peft_adapter_served_from_this_host(server, client, trained):
    rest = client.create_rest_client()
    path = trained.save_weights_external("ext").result().path
    assert path == f"tinker://{trained.model_id}/external_weights/ext"
    got = rest.get_external_weights_urls(path).result()
    assert sorted(got.urls) == ["adapter_config.json", "adapter_model.safetensors"]
    folder = _file(server, path, "")
    for name, url in got.urls.items():
        assert url.startswith(server.url + "/")
        with urllib.request.urlopen(url) as r:  # no API key: the URL is signed
            assert r.read() == (folder / name).read_bytes()
    config = json.loads((folder / "adapter_config.json").read_text())
    assert (config["r"], config["lora_alpha"], config["base_model_name_or_path"]) == (
        4, 32, "tiny")
    tensors = read_safetensors(folder / "adapter_model.safetensors")
    a = tensors["base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"]
    m = server.service.backend.get(trained.model_id)
    q_a = m.adapters["layers"][0]["attn"]["q_lora_a"]
    assert np.array_equal(a, np.asarray(q_a, np.float32).reshape(-1, 4).T)  # PEFT: A is [r, in]
    with pytest.raises(urllib.error.HTTPError, match="403"):
        urllib.request.urlopen(got.urls["adapter_config.json"].replace("signature=",
                                                                       "signature=0"))
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert not folder.exists()


def test_publish_lets_another_key_load_and_copy_shares_the_files(server, client, bob,
                                                                 trained):
    rest, bob_rest = client.create_rest_client(), bob.create_rest_client()
    path = trained.save_weights_for_sampler("pub").result().path
    with pytest.raises(tinker.NotFoundError, match="unknown training run"):
        bob_rest.list_checkpoints(trained.model_id).result()
    with pytest.raises(tinker.NotFoundError, match="unknown weights path"):
        bob_rest.get_weights_info_by_tinker_path(path).result()
    rest.publish_checkpoint_from_tinker_path(path).result()
    run = bob_rest.get_training_run(trained.model_id, access_scope="accessible").result()
    assert run.last_sampler_checkpoint.tinker_path == path
    with pytest.raises(tinker.NotFoundError, match="unknown training run"):
        bob_rest.get_training_run(trained.model_id).result()  # owned: Alice's
    assert rest.list_checkpoints(trained.model_id).result().checkpoints[-1].public
    info = bob_rest.get_weights_info_by_tinker_path(path).result()
    assert (info.base_model, info.is_lora, info.lora_rank) == ("tiny", True, 4)
    copy = bob_rest.copy_weights(path, "proj-b").result()
    assert copy.startswith("tinker://copy-") and copy.endswith("/sampler_weights/pub")
    assert os.stat(_file(server, copy)).st_ino == os.stat(_file(server, path)).st_ino
    assert [r.training_run_id for r in bob_rest.list_training_runs(project_id="proj-b")
            .result().training_runs] == [copy.split("/")[2]]
    rest.unpublish_checkpoint_from_tinker_path(path).result()
    with pytest.raises(tinker.NotFoundError, match="unknown weights path"):
        bob_rest.get_weights_info_by_tinker_path(path).result()
    rest.delete_checkpoint_from_tinker_path(path).result()
    assert bob_rest.get_weights_info_by_tinker_path(copy).result().lora_rank == 4


# ---------------------------------------------------------------------------- the SDK probe

CLIENTS = (tinker.ServiceClient, tinker.TrainingClient, tinker.SamplingClient, tinker.RestClient)
SERVICE = "tests/service/"
# every public method of the SDK's four clients that this server serves -> the test file whose
# source calls it (the `*_async` twins call these: covered with them)
WORKS = {
    "close": "test_service.py", "create_lora_training_client": "test_service.py",
    "create_sampling_client": "test_service.py", "create_rest_client": "test_rest.py",
    "create_training_client_from_state": "test_stop_and_from_state.py",
    "create_training_client_from_state_with_optimizer": "test_stop_and_from_state.py",
    "get_server_capabilities": "test_rest.py", "copy_weights": "test_rest.py",
    "create_custom_loss": "test_rest.py", "forward_backward_custom": "test_rest.py",
    "forward": "test_service.py", "forward_backward": "test_service.py",
    "optim_step": "test_service.py", "get_info": "test_rest.py", "load_state": "test_rest.py",
    "load_state_with_optimizer": "test_durability.py", "save_state": "test_rest.py",
    "save_weights_for_sampler": "test_rest.py", "save_weights_external": "test_rest.py",
    "save_weights_and_get_sampling_client": "test_service.py", "sample": "test_service.py",
    "compute_logprobs": "test_rest.py", "get_base_model": "test_rest.py",
    "get_sampler_handle": "test_rest.py", "from_sampler_handle": "test_rest.py",
    "get_sampler": "test_rest.py", "list_training_runs": "test_rest.py",
    "get_training_run": "test_rest.py", "get_training_run_by_tinker_path": "test_rest.py",
    "get_weights_info_by_tinker_path": "test_rest.py", "list_checkpoints": "test_rest.py",
    "list_user_checkpoints": "test_rest.py", "delete_checkpoint": "test_rest.py",
    "delete_checkpoint_from_tinker_path": "test_rest.py",
    "set_checkpoint_ttl_from_tinker_path": "test_rest.py",
    "publish_checkpoint_from_tinker_path": "test_rest.py",
    "unpublish_checkpoint_from_tinker_path": "test_rest.py",
    "get_external_weights_urls": "test_rest.py",
}
# -> why not (docs/service.md's table says the same); the server-side refusals are checked below
REFUSED = {
    "get_console_url": "client-side: a URL of Tinker's hosted console; this server has none",
    "get_telemetry": "client-side: the SDK's own telemetry (its posts to /api/v1/telemetry "
                     "are answered and dropped)",
    "holder": "the SDK's connection holder, not a call",
    "get_tokenizer": "client-side: loads the base model's tokenizer from the Hugging Face Hub "
                     "by name; works for a Hub id, not for a local directory or tiny",
    "on_queue_state_change": "client-side hook for a polled request's queue state; this server "
                             "always reports 'active'",
    "create": "the SDK's internal factory behind ServiceClient.create_sampling_client",
    "whoami": "client-side: needs JWT auth, which this server does not enable (RuntimeError)",
    "list_sessions": "server: sessions are not listed", "search_sessions": "server: sessions "
    "are not searchable", "get_session": "server: sessions are not listed",
    "assign_session_project": "server: no projects", "export_session_trace": "server: no "
    "session traces", "get_audit_log": "server: no audit log", "get_billing_usage": "server: "
    "bills nothing", "get_current_checkpoint_storage_usage": "server: bills nothing",
}


def test_sdk_probe_every_public_method_is_tested_or_refused_with_a_reason():
    """Issue 48's probe: each public method of the SDK's four clients (tinker 0.38.0) is called
    by a test of this directory, or is listed as refused with the reason."""
    public = {n for cls in CLIENTS for n in dir(cls) if not n.startswith("_")}
    twins = {n for n in public if n.endswith("_async") and n.removesuffix("_async") in public}
    assert public - twins == set(WORKS) | set(REFUSED), (
        sorted(public - twins - set(WORKS) - set(REFUSED)),
        sorted(set(WORKS) | set(REFUSED) - public))
    assert not set(WORKS) & set(REFUSED)
    sources = {}
    for name, file in WORKS.items():
        if file not in sources:
            with open(os.path.join(os.path.dirname(__file__), file)) as f:
                sources[file] = f.read()
        assert f".{name}(" in sources[file], f"{name} is not called in {file}"


def test_sdk_calls_not_tested_elsewhere_work(server, client, trained, monkeypatch):
    rest = client.create_rest_client()
    caps = rest.get_server_capabilities().result()
    assert [m.model_name for m in caps.supported_models] == ["tiny"]
    datum = tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints([3, 4, 5, 6]),
                               loss_fn_inputs={"target_tokens": [4, 5, 6, 7],
                                               "weights": [1.0, 1.0, 0.0, 1.0]})

    def neg_ll(logprobs, weights):
        loss = -(logprobs * weights).sum()
        return loss, {"custom/neg_ll:sum": loss}

    handle = client.create_custom_loss(neg_ll, {"logprobs": 1, "weights": 1}).result()
    out = trained.forward_backward_custom([datum], handle).result()
    logp = trained.forward([datum], "cross_entropy").result().loss_fn_outputs[0]["logprobs"]
    want = -float(np.sum(logp.to_numpy() * np.array([1, 1, 0, 1])))
    assert out.metrics["custom/neg_ll:sum"] == pytest.approx(want, rel=1e-5)
    trained.optim_step(tinker.types.AdamParams(learning_rate=0.0)).result()  # drop the grads

    path = trained.save_weights_for_sampler("probe").result().path
    sc = client.create_sampling_client(model_path=path).result()
    assert sc.get_base_model() == "tiny"
    prompt = tinker.types.ModelInput.from_ints([3, 4, 5, 6, 7])
    got = sc.compute_logprobs(prompt).result()
    fwd = trained.forward([tinker.types.Datum(model_input=tinker.types.ModelInput.from_ints(
        [3, 4, 5, 6]), loss_fn_inputs={"target_tokens": [4, 5, 6, 7]})], "cross_entropy")
    assert got[0] is None
    np.testing.assert_allclose(got[1:], fwd.result().loss_fn_outputs[0]["logprobs"].to_numpy(),
                               rtol=1e-5)
    handle = sc.get_sampler_handle()
    again = tinker.SamplingClient.from_sampler_handle(handle, api_key=ALICE)
    params = tinker.types.SamplingParams(max_tokens=4, seed=5, temperature=1.0)
    assert (again.sample(prompt, 1, params).result().sequences[0].tokens
            == sc.sample(prompt, 1, params).result().sequences[0].tokens)
    sampler = rest.get_sampler(sc._sampling_session_id).result()
    assert (sampler.base_model, sampler.model_path) == ("tiny", path)

    monkeypatch.setenv("TINKER_PROJECT_ID", "proj-probe")  # the SDK's copy needs a project
    copied = client.copy_weights(path).result()
    assert copied.endswith("/sampler_weights/probe") and copied != path
    run_id, _, _ = copied.removeprefix("tinker://").split("/")
    rest.delete_checkpoint(run_id, "sampler_weights/probe").result()
    assert rest.list_checkpoints(run_id).result().checkpoints == []
    assert _file(server, path).exists()  # the source keeps its files


def test_sdk_calls_this_server_refuses_say_what_is_unsupported(server, client):
    rest = client.create_rest_client()
    calls = {
        "list_sessions": lambda: rest.list_sessions(),
        "search_sessions": lambda: rest.search_sessions(
            tinker.types.SessionSearchRequest(session_id="s")),
        "get_session": lambda: rest.get_session("session-x"),
        "assign_session_project": lambda: rest.assign_session_project("session-x", "p"),
        "export_session_trace": lambda: rest.export_session_trace("session-x"),
        "get_audit_log": lambda: rest.get_audit_log(),
        "get_billing_usage": lambda: rest.get_billing_usage("2026-01-01", "2026-02-01"),
        "get_current_checkpoint_storage_usage":
            lambda: rest.get_current_checkpoint_storage_usage(),
    }
    assert set(calls) == {n for n, why in REFUSED.items() if why.startswith("server:")}
    for name, call in calls.items():
        with pytest.raises(tinker.BadRequestError, match=f"RestClient.{name} is not supported"):
            call().result()
    with pytest.raises(RuntimeError, match="whoami requires JWT auth"):
        rest.whoami().result()


def test_topk_and_target_prompt_logprobs_equal_the_models_distribution(server, client,
                                                                      trained):
    """The distillation recipes' soft targets (row t: the k most likely tokens after
    prompt[:t]) and the decisions recipe's label scores (cell [i, j]: log p(ids[i, j] |
    prompt[:i + 1])), checked against the model's full distribution computed here (numpy
    log-softmax of the snapshot's logits)."""
    from flax import nnx

    from jaxrl.models import lora

    path = trained.save_weights_for_sampler("topk").result().path
    sc = client.create_sampling_client(model_path=path).result()
    prompt = [3, 9, 4, 12, 5, 7]
    res = sc.sample(tinker.types.ModelInput.from_ints(prompt), 1,
                    tinker.types.SamplingParams(max_tokens=2, seed=0),
                    include_prompt_logprobs=True, topk_prompt_logprobs=5).result()
    backend = server.service.backend
    snap = backend.snapshots[path]
    model = nnx.merge(snap.graphdef, lora.join(backend.base, snap.adapters))
    logits = np.asarray(model.logits(model.hidden(np.asarray([prompt], np.int32))))[0]
    logp = logits - np.log(np.sum(np.exp(logits - logits.max(-1, keepdims=True)), -1,
                                  keepdims=True)) - logits.max(-1, keepdims=True)
    rows = res.topk_prompt_logprobs
    assert len(rows) == len(prompt) and rows[0] is None
    for t in range(1, len(prompt)):
        want = np.argsort(-logp[t - 1])[:5]
        assert [i for i, _ in rows[t]] == want.tolist(), t
        np.testing.assert_allclose([v for _, v in rows[t]], logp[t - 1][want], atol=2e-5)
        assert res.prompt_logprobs[t] == pytest.approx(logp[t - 1][prompt[t]], abs=2e-5)
    last2 = sc.sample(tinker.types.ModelInput.from_ints(prompt), 1,
                      tinker.types.SamplingParams(max_tokens=2, seed=0),
                      include_prompt_logprobs=True, topk_prompt_logprobs=5,
                      prompt_logprobs_last_n=2).result().topk_prompt_logprobs
    assert last2[:4] == [None] * 4 and last2[4:] == rows[4:]
    # target_prompt_logprobs, as the cookbook's decisions recipe sends it (sparse) and dense
    import torch

    ids = torch.full((len(prompt) - 1, 3), -1, dtype=torch.int64)
    ids[2] = torch.tensor([7, 1, 30])
    ids[4, 1] = 9
    for target in (tinker.TensorData.from_torch_sparse(ids, pad_value=-1),
                   tinker.TensorData.from_torch(ids)):
        got = sc.sample(tinker.types.ModelInput.from_ints(prompt), 1,
                        tinker.types.SamplingParams(max_tokens=1),
                        target_prompt_logprobs=target).result().target_prompt_logprobs
        assert got.shape == [len(prompt) - 1, 3]
        dense = got.to_numpy() if got.sparse_crow_indices is None else np.asarray(
            got.to_torch().to_dense())
        np.testing.assert_allclose(dense[2], logp[2][[7, 1, 30]], atol=2e-5)
        assert dense[4, 1] == pytest.approx(logp[4][9], abs=2e-5)
        if got.sparse_crow_indices is None:  # dense: a cell that asked for nothing is NaN
            assert np.isnan(dense[0, 0]) and np.isnan(dense[4, 0])
        else:  # sparse: the request's cells only
            assert got.sparse_col_indices == [0, 1, 2, 1]
    with pytest.raises(tinker.BadRequestError, match="topk_prompt_logprobs must be an integer"):
        sc.sample(tinker.types.ModelInput.from_ints(prompt), 1,
                  tinker.types.SamplingParams(max_tokens=2), topk_prompt_logprobs=10**6).result()
