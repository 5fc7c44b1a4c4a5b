"""Stop strings in `sample` (checked on the text the base model's tokenizer decodes), and training
clients created from a saved state through the SDK (`create_training_client_from_state` and
`..._with_optimizer`), on the `tiny` model (whose tokenizer is jaxrl's character tokenizer)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
import tinker
from tinker import types

from jaxrl.service.backend import Backend
from jaxrl.service.server import Running, Service
from jaxrl.tokenizers import CharTokenizer

ALICE, BOB = "tml-alice-key", "tml-bob-key"
PROMPT = types.ModelInput.from_ints([3, 4, 5, 6, 7])


@pytest.fixture(scope="module")
def server():
    running = Running(Service(Backend.load("tiny", max_len=64, num_slots=4),
                              api_keys=[ALICE, BOB]))
    yield running
    running.stop()


@pytest.fixture(scope="module")
def alice(server):
    client = tinker.ServiceClient(base_url=server.url, api_key=ALICE)
    yield client
    client.close("success").result()


def sample(sc, **params):
    return sc.sample(PROMPT, 1, types.SamplingParams(seed=3, **params)).result().sequences[0]


def test_stop_strings_end_the_sample_where_the_text_contains_them(server, alice):
    sc = alice.create_sampling_client(base_model="tiny").result()
    ref = sample(sc, max_tokens=12, stop=[])  # the same seed, no stop at all
    chars = CharTokenizer()
    pieces = [chars.decode([t], stop_at_eos=False, errors="replace") for t in ref.tokens]
    ends = np.cumsum([len(p) for p in pieces])  # text length after each token
    # a stop string from the middle of the reference text, as two tokens spell it
    mid = next(i for i in range(3, len(pieces)) if len(pieces[i - 1]) == len(pieces[i]) == 1
               and "\ufffd" not in pieces[i - 1] + pieces[i])
    stop = pieces[mid - 1] + pieces[mid]
    text = "".join(pieces)
    first_end = text.index(stop) + len(stop)  # the sample ends at the token completing it
    expected = ref.tokens[:int(np.searchsorted(ends, first_end)) + 1]

    got = sample(sc, max_tokens=12, stop=[stop, "never~~"])
    assert got.tokens == expected and got.stop_reason == "stop"
    np.testing.assert_array_equal(got.logprobs, ref.logprobs[:len(expected)])
    assert sample(sc, max_tokens=12, stop=stop).tokens == expected  # one string, not a list

    never = sample(sc, max_tokens=6, stop="never~~")  # '~' twice: not in the reference's head
    assert "never~~" not in text
    assert never.tokens == ref.tokens[:6] and never.stop_reason == "length"

    with pytest.raises(tinker.BadRequestError, match="non-empty strings"):
        sample(sc, max_tokens=4, stop=["a", ""])
    decode, server.service.backend.decode = server.service.backend.decode, None
    try:  # a base model without a tokenizer refuses them, saying why
        with pytest.raises(tinker.BadRequestError, match="need the base model's tokenizer"):
            sample(sc, max_tokens=4, stop="ab")
    finally:
        server.service.backend.decode = decode


def test_stop_text_decoder_gives_every_id_text(tmp_path):
    """A padded model vocabulary samples ids the tokenizer lacks; each must still add text, or
    `StopText`'s window of ids (as long as the string's bytes) misses strings around them."""
    import importlib.util
    from pathlib import Path

    from jaxrl.generate.stops import StopText
    from jaxrl.service.backend import text_decoder
    from jaxrl.tokenizers import HFTokenizer

    spec = importlib.util.spec_from_file_location(
        "cookbook_offline_cache",
        Path(__file__).resolve().parents[2] / "examples" / "cookbook_offline_cache.py")
    cache = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(cache)
    assert cache.write_tokenizer(tmp_path) == 261  # byte-level, Llama 3's specials
    tok = HFTokenizer(tmp_path)
    decode = text_decoder(tok)
    assert all(decode([i]) for i in range(512))  # ids 261..511: the model's padded rows
    ab, eot = tok.encode("ab"), tok.encode("<|eot_id|>")
    assert decode([*ab, 300, *eot]) == "ab\ufffd<|eot_id|>"
    assert StopText(("b<|eot",), decode).find([*ab, 300, *eot]) is None
    assert StopText(("<|eot_id|>",), decode).find([*ab, 300, *eot]) == 4


def datum(tokens):
    return types.Datum(model_input=types.ModelInput.from_ints(tokens[:-1]),
                       loss_fn_inputs={"target_tokens": np.array(tokens[1:])})


DATA = [datum(list(range(3, 19))), datum([5, 9, 11, 5, 9, 11, 5, 9, 11, 5])]
ADAM = types.AdamParams(learning_rate=1e-2)


def step(tc):  # one at a time: nothing shares a batched step, so the results are bit-exact
    tc.forward_backward(DATA, "cross_entropy").result()
    tc.optim_step(ADAM).result()


def logprobs(tc):
    return [np.asarray(o["logprobs"].tolist())
            for o in tc.forward(DATA, "cross_entropy").result().loss_fn_outputs]


def test_training_client_from_saved_state(server, alice):
    original = alice.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    step(original)
    state = original.save_state("resume").result().path
    saved_lp = logprobs(original)

    weights_only = alice.create_training_client_from_state(state).result()
    with_opt = alice.create_training_client_from_state_with_optimizer(state).result()
    assert len({original.model_id, weights_only.model_id, with_opt.model_id}) == 3
    for tc in (weights_only, with_opt):
        assert tc.get_info().lora_rank == 4
        for a, b in zip(logprobs(tc), saved_lp, strict=True):
            np.testing.assert_array_equal(a, b)

    adapters = lambda tc: jax.tree.map(np.asarray,
                                       server.service.backend.models[tc.model_id].adapters)
    for tc in (original, with_opt, weights_only):
        step(tc)
    # Adam's moments and step count came along: the next step is the original's, bit for bit
    jax.tree.map(np.testing.assert_array_equal, adapters(with_opt), adapters(original))
    # ... and without them it is a first Adam step, which differs
    diffs = jax.tree.map(lambda a, b: float(np.abs(a - b).max()), adapters(weights_only),
                         adapters(original))
    assert max(jax.tree.leaves(diffs)) > 1e-4

    bob = tinker.ServiceClient(base_url=server.url, api_key=BOB)
    try:  # another key's path is unknown to BOB, as a path that does not exist
        with pytest.raises(tinker.NotFoundError, match="unknown weights path"):
            bob.create_training_client_from_state_with_optimizer(state).result()
        with pytest.raises(tinker.NotFoundError, match="unknown weights path"):
            alice.create_training_client_from_state(state + "-missing").result()
    finally:
        bob.close("success").result()
