"""The service's RestClient side (training runs, checkpoints, TTLs, deletion, publishing, external
weights, copies), its SDK probe (every public method of the four SDK clients works or is refused,
naming what), and a new LoRA client's cost, driven by the official `tinker` SDK against a tiny
random model with a state directory (one server for the module)."""

from __future__ import annotations

import time

import jax
import pytest
import tinker

from jaxrl.service.backend import Backend, lora_config
from jaxrl.service.server import Running, Service

_COMPILES: list[int] = []  # one entry per XLA compilation while a test listens (see below)


def _count_compile(event: str, duration: float, **_kw) -> None:
    if _COMPILES and event == "/jax/core/compile/backend_compile_duration":
        _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    state = tmp_path_factory.mktemp("state")
    running = Running(Service(Backend.load("tiny", max_len=64, num_slots=4, state_dir=state)))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def client(server):
    service_client = tinker.ServiceClient(base_url=server.url, api_key="tml-local")
    yield service_client
    service_client.close("success").result()


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
