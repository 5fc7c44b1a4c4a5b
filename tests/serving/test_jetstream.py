"""The JetStream adapter against the real `google-jetstream` package (its in-process Driver).

Runs in the separate environment that `.ci/jetstream.sh` builds (JetStream pulls TensorFlow
through seqio); in the main environment the whole module is skipped.
"""

import pytest

pytest.importorskip(
    "jetstream.engine.engine_api",
    reason="google-jetstream is not installed (the `jetstream` extra; run .ci/jetstream.sh)",
)

import asyncio  # noqa: E402
import logging  # noqa: E402
import threading  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
from flax import nnx  # noqa: E402
from jetstream.core import orchestrator  # noqa: E402
from jetstream.core.proto import jetstream_pb2  # noqa: E402

from jaxrl.generate import JaxEngine, SamplingParams, sample  # noqa: E402
from jaxrl.models import create_model  # noqa: E402
from jaxrl.serving.jetstream_adapter import (  # noqa: E402
    NO_BOS,
    JetStreamEngine,
    make_driver,
    make_jetstream_engines,
)
from jaxrl.sharding import make_mesh  # noqa: E402
from jaxrl.testing import tiny_model_config  # noqa: E402
from jaxrl.tokenizers import CharTokenizer  # noqa: E402

logging.getLogger().setLevel(logging.WARNING)  # JetStream sets the root logger to DEBUG

pytestmark = pytest.mark.timeout(900)
TIMEOUT_S = 300.0  # per batch of requests; a hang guard (a run takes seconds without contention)
MAX_LEN, SLOTS = 64, 2  # fewer slots than requests: slots are freed and refilled
PROMPTS = [[5], [7, 8, 9, 10, 11], list(range(20, 37)), [3, 40, 41, 42] * 7]  # 1 .. 28 tokens
MAX_TOKENS = [6, 11, 3, 9]


@pytest.fixture(scope="module")
def model():
    """The tiny model with weights redrawn at std 0.2: at its default init, greedy decoding just
    repeats the last prompt token, which would hide an off-by-one in the token stream."""
    graphdef, state = nnx.split(create_model(tiny_model_config(), seed=0))
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(1), len(leaves))
    leaves = [x if float(jnp.std(x)) == 0 else 0.2 * jax.random.normal(k, x.shape, x.dtype)
              for x, k in zip(leaves, keys, strict=True)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, leaves))


@pytest.fixture(scope="module")
def tok():
    return CharTokenizer()


@pytest.fixture(scope="module")
def reference(model):
    """Greedy `jaxrl.generate.sample` (one engine, compiled once; same cache length and slots as
    the served engines): completion tokens per prompt, cut to each `max_tokens`."""
    engine = JaxEngine(model, num_slots=SLOTS, max_len=MAX_LEN)

    def run(prompts, max_tokens, stop_token_ids=()):
        sp = SamplingParams(temperature=0.0, max_tokens=max(max_tokens),
                            stop_token_ids=stop_token_ids)
        done = sample(engine, prompts, sp)
        return [c.tokens[:m] for c, m in zip(done, max_tokens, strict=True)]

    return run


@pytest.fixture(scope="module")
def interleaved(model, tok):
    """One engine for prefill and generate (JetStream's interleaved mode), no EOS."""
    return make_jetstream_engines(model, num_slots=SLOTS, max_len=MAX_LEN, tokenizer=tok,
                                  eos_ids=())


def _token_request(ids, max_tokens):
    return jetstream_pb2.DecodeRequest(
        token_content=jetstream_pb2.DecodeRequest.TokenContent(token_ids=ids),
        max_tokens=max_tokens)


def _text_request(text, max_tokens):
    return jetstream_pb2.DecodeRequest(
        text_content=jetstream_pb2.DecodeRequest.TextContent(text=text), max_tokens=max_tokens)


def _serve(engines, requests):
    """Submit all requests at once through JetStream's Driver; (token ids, text) per request.

    The event loop runs in its own thread until the driver has stopped, as in JetStream's server:
    the detokenize thread still posts to a request's loop just after the client has seen the
    stream's end, and a closed loop there makes JetStream kill the process.
    """
    driver = make_driver(*engines)
    loop = asyncio.new_event_loop()
    loop_thread = threading.Thread(target=loop.run_forever, daemon=True)
    loop_thread.start()
    try:
        client = orchestrator.LLMOrchestrator(driver=driver)

        async def one(req):
            ids, text = [], []
            async for resp in client.Decode(req):
                for s in resp.stream_content.samples:
                    ids.extend(s.token_ids)
                    text.append(s.text)
            return ids, "".join(text)

        async def all_requests():
            return await asyncio.gather(*(one(r) for r in requests))

        return asyncio.run_coroutine_threadsafe(all_requests(), loop).result(TIMEOUT_S)
    finally:
        driver.stop()
        loop.call_soon_threadsafe(loop.stop)
        loop_thread.join()
        loop.close()


def test_engine_implements_jetstream_api(model, tok, interleaved):
    prefill, generate = interleaved
    assert prefill is generate and isinstance(prefill, JetStreamEngine)
    assert not JetStreamEngine.__abstractmethods__
    assert generate.max_concurrent_decodes == SLOTS and generate.samples_per_slot == 1
    assert generate.max_prefill_length == 32 and generate.mesh.devices.size == 1
    t = generate.build_tokenizer(generate.get_tokenizer())
    assert (t.bos_id, t.pad_id, t.eos_id, t.stop_tokens) == (2, 0, 1, set())
    with pytest.raises(ValueError, match="prefill buckets"):
        make_jetstream_engines(model, num_slots=SLOTS, max_len=MAX_LEN, max_prefill_length=48)
    with pytest.raises(ValueError, match="both prefill_mesh and generate_mesh"):
        make_jetstream_engines(model, num_slots=SLOTS, max_len=MAX_LEN,
                               generate_mesh=make_mesh((1, 1), "generator", jax.devices()[:1]))


def test_interleaved_greedy_matches_sample(tok, interleaved, reference):
    """Token-id requests of different lengths and max_tokens, more requests than slots: JetStream
    prepends BOS, so each stream equals `sample([bos] + prompt)`."""
    requests = [_token_request(p, m) for p, m in zip(PROMPTS, MAX_TOKENS, strict=True)]
    got = _serve(interleaved, requests)
    want = reference([[tok.bos_id, *p] for p in PROMPTS], MAX_TOKENS)
    assert [ids for ids, _ in got] == want
    assert [len(ids) for ids, _ in got] == MAX_TOKENS
    assert len(set(want[1])) > 3  # the model does not just repeat a token


def test_tokenizer_without_bos(interleaved, reference):
    """With no BOS id (Qwen-style, or no tokenizer) the placeholder JetStream prepends is dropped:
    the stream equals `sample(prompt)`. Shares the interleaved engine's compiled functions."""
    engine = JetStreamEngine(interleaved[0].engine, tokenizer=None)
    assert engine.build_tokenizer(engine.get_tokenizer()).bos_id == NO_BOS
    got = _serve((engine, engine), [_token_request(p, m) for p, m in zip(PROMPTS[:2], [5, 7],
                                                                             strict=True)])
    assert [ids for ids, _ in got] == reference(PROMPTS[:2], [5, 7])


def test_disaggregated_meshes_text_and_stop(model, tok, reference):
    """Prefill (tp=2) and generate (dp=2 x tp=2) on disjoint meshes, text requests, a stop id:
    the stream is `sample`'s completion without its final stop token, and the text is its
    decoding."""
    devices = jax.devices()
    if len(devices) < 6:
        pytest.skip("needs 6 devices (tests/conftest.py simulates 8 CPU devices)")
    texts = ["a", "hello", "The quick brown fox!", "0123456789" * 2]
    prompts = [[tok.bos_id, *tok.encode(t)] for t in texts]
    stop = reference(prompts, [12] * 4)[1][4]  # greedy reaches it: one request ends early
    want = reference(prompts, [12] * 4, stop_token_ids=(stop,))
    assert any(w[-1] == stop for w in want)

    engines = make_jetstream_engines(
        model, num_slots=SLOTS, max_len=MAX_LEN, tokenizer=tok,
        sampling=SamplingParams(temperature=0.0, stop_token_ids=(stop,)),
        prefill_mesh=make_mesh((1, 2), "generator", devices[:2]),  # tp=2
        generate_mesh=make_mesh((2, 2), "generator", devices[2:6]))  # dp=2 x tp=2
    assert engines[0] is not engines[1]
    got = _serve(engines, [_text_request(t, 12) for t in texts])
    for (ids, text), w in zip(got, want, strict=True):
        expected = w[:-1] if w[-1] == stop else w
        assert ids == expected
        assert text == "".join(tok.decode([t]) if t < tok.vocab_size else "" for t in expected)


def test_rejected_request_gets_empty_stream(tok, interleaved, reference):
    """An out-of-vocabulary token id is answered with no tokens; the server keeps serving."""
    got = _serve(interleaved, [_token_request([5, 10_000], 4), _token_request([5], 4)])
    assert got[0][0] == []
    assert got[1][0] == reference([[tok.bos_id, 5]], [4])[0]


def test_launcher_builds_engines():
    """`python -m jaxrl.serving.jetstream` argument handling (the gRPC server is not started)."""
    from jaxrl.serving import jetstream as launcher

    args = launcher.parse_args(["--model", "tiny", "--num-slots", "2", "--max-len", "64"])
    prefill, generate = launcher.build(args)
    assert prefill is generate and generate.max_concurrent_decodes == 2
    assert generate.build_tokenizer(generate.get_tokenizer()).bos_id == CharTokenizer().bos_id
    args = launcher.parse_args(["--model", "tiny", "--max-len", "64", "--prefill-devices", "1",
                                "--generate-devices", "2", "--tokenizer", "none"])
    prefill, generate = launcher.build(args)
    assert prefill.mesh.devices.size == 1 and generate.mesh.devices.size == 2
