"""`stable_reinforce` with `record_stability_info` (jaxrl/service/stability.py): the records'
lifetime and ownership against a fake clock, and through the official SDK against a tiny random
model: datums built as tinker-cookbook 0.6.1's `rl_loop` builds them, the loss checked against
numpy on the returned log-probabilities, and each bad provenance refused naming what is wrong."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from tinker import types

from jaxrl.service.backend import Backend, UserError
from jaxrl.service.server import Running, Service
from jaxrl.service.stability import TTL_S, StabilityRecords
from jaxrl.service.wire import Datum


def _datum(prompt, sampled, sid, *, spans=True):
    """A wire datum as `rl_loop` sends it: input prompt + sampled[:-1], targets shifted."""
    tokens = np.array(prompt + sampled[:-1], np.int32)
    targets = np.array(prompt[1:] + sampled, np.int64)
    run = [("prompt", sid, 0, len(prompt)), ("sampled", sid, 0, len(sampled) - 1)]
    loss = [("prompt", sid, 1, len(prompt) - 1), ("sampled", sid, 0, len(sampled))]
    return Datum(tokens, {"target_tokens": targets}, (run, loss) if spans else None)


def test_records_last_a_day_after_last_use_and_belong_to_their_key():
    now = [0.0]
    records = StabilityRecords(clock=lambda: now[0])
    records.record(["s1", "s2"], "owner-a", [7, 8, 9], [([4, 5], [-0.5, -1.5]), ([6], [-2.0])])
    d = _datum([7, 8, 9], [4, 5], "s1")
    records.attach("stable_reinforce", [d], "owner-a")
    # targets [8, 9, 4, 5]: two prompt positions, then the sampled ones with their logprobs
    np.testing.assert_array_equal(d.inputs["sampled"], [0, 0, 1, 1])
    np.testing.assert_array_equal(d.inputs["recorded_logprobs"], [0, 0, -0.5, -1.5])
    with pytest.raises(UserError, match="unknown sequence_id 's1'"):  # another key's
        records.attach("stable_reinforce", [_datum([7, 8, 9], [4, 5], "s1")], "owner-b")
    now[0] = 0.9 * TTL_S  # s1 used again: its day restarts; s2 (unused) keeps its first one
    records.attach("stable_reinforce", [_datum([7, 8, 9], [4, 5], "s1")], "owner-a")
    now[0] = 1.5 * TTL_S
    assert len(records) == 1
    records.attach("stable_reinforce", [_datum([7, 8, 9], [4, 5], "s1")], "owner-a")
    with pytest.raises(UserError, match="sequence_id 's2' has expired"):
        records.attach("stable_reinforce", [_datum([7, 8, 9], [6], "s2")], "owner-a")
    now[0] = 2.6 * TTL_S
    with pytest.raises(UserError, match="sequence_id 's1' has expired"):
        records.attach("stable_reinforce", [_datum([7, 8, 9], [4, 5], "s1")], "owner-a")
    with pytest.raises(UserError, match="unknown sequence_id 's1'"):  # expired, and not b's
        records.attach("stable_reinforce", [_datum([7, 8, 9], [4, 5], "s1")], "owner-b")


def test_claims_are_checked_against_the_record():
    records = StabilityRecords()
    records.record(["s"], None, [7, 8, 9], [([4, 5], [-0.5, -1.5])])
    with pytest.raises(UserError, match="datum 0: loss_fn stable_reinforce needs provenance"):
        records.attach("stable_reinforce", [_datum([7, 8, 9], [4, 5], "s", spans=False)], None)
    with pytest.raises(UserError, match=r"target_tokens positions 2\.\.3 are not the sampled "
                                        r"tokens 0\.\.1 of sequence 's'"):
        records.attach("stable_reinforce", [_datum([7, 8, 9], [4, 6], "s")], None)
    with pytest.raises(UserError, match="model_input provenance spans cover 4 positions but "
                                        "model_input has 3"):
        bad = _datum([7, 8, 9], [4, 5], "s")
        bad.tokens = bad.tokens[:3]
        records.attach("stable_reinforce", [bad], None)
    with pytest.raises(UserError, match="'recorded_logprobs' is filled by the server"):
        sent = _datum([7, 8, 9], [4, 5], "s")
        sent.inputs["recorded_logprobs"] = np.zeros(4, np.float32)
        records.attach("stable_reinforce", [sent], None)
    plain = _datum([7, 8, 9], [4, 5], "nowhere", spans=False)
    records.attach("importance_sampling", [plain], None)  # other losses read no records
    assert set(plain.inputs) == {"target_tokens"}


@pytest.fixture(scope="module")
def client():
    running = Running(Service(Backend.load("tiny", max_len=64, num_slots=4)))
    service_client = tinker.ServiceClient(base_url=running.url, api_key="tml-local")
    yield service_client
    service_client.close("success").result()
    running.stop()


def _rl_loop_datum(prompt, seq, advantage, sid=None):
    """`tinker_cookbook.recipes.rl_loop` 0.6.1's datum and `with_sampled_provenance`."""
    ob_len = len(prompt) - 1
    d = types.Datum(
        model_input=types.ModelInput.from_ints(prompt + seq.tokens[:-1]),
        loss_fn_inputs={"target_tokens": [0] * ob_len + seq.tokens,
                        "logprobs": [0.0] * ob_len + seq.logprobs,
                        "advantages": [0.0] * ob_len + [advantage] * len(seq.tokens)})
    sid = sid or seq.sequence_id
    return d.with_provenance(
        model_input=[types.PromptProvenanceSpan(sequence_id=sid, length=len(prompt)),
                     types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens) - 1)],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=len(prompt) - 1),
            types.SampledProvenanceSpan(sequence_id=sid, length=len(seq.tokens))])


def test_sdk_trains_stable_reinforce_on_recorded_sequences(client):
    tc = client.create_lora_training_client(base_model="tiny", rank=4, seed=0).result()
    sc = tc.save_weights_and_get_sampling_client(record_stability_info=True).result()
    prompt = [3, 4, 5, 6]
    res = sc.sample(types.ModelInput.from_ints(prompt), 4,
                    types.SamplingParams(max_tokens=6, seed=5, temperature=1.0)).result()
    ids = [s.sequence_id for s in res.sequences]
    assert len(set(ids)) == 4
    adv = [1.0, -1.0, 0.5, -0.5]
    data = [_rl_loop_datum(prompt, s, a) for s, a in zip(res.sequences, adv, strict=True)]
    out = tc.forward_backward(data, "stable_reinforce").result()
    # by hand from the returned log-probabilities and the sampled ones (what was recorded):
    # L = -sum over sampled positions of w A log p, w = r inside [0.5, 2] (else 0)
    expect = 0.0
    for s, a, o in zip(res.sequences, adv, out.loss_fn_outputs, strict=True):
        logp = o["logprobs"].to_numpy()[len(prompt) - 1:]
        r = np.exp(logp - np.array(s.logprobs))
        w = np.where((r >= 0.5) & (r <= 2.0), r, 0.0)
        assert w.min() > 0  # on-policy: the trainer agrees with the sampler within the band
        expect += float(np.sum(-w * a * logp))
    assert out.metrics["loss:sum"] == pytest.approx(expect, rel=1e-4)
    tc.optim_step(types.AdamParams(learning_rate=1e-2)).result()

    # a sampling client without record_stability_info records nothing
    plain = tc.save_weights_and_get_sampling_client().result().sample(
        types.ModelInput.from_ints(prompt), 1, types.SamplingParams(max_tokens=4, seed=1)
    ).result().sequences[0]
    with pytest.raises(tinker.BadRequestError, match=f"unknown sequence_id '{plain.sequence_id}'"):
        tc.forward_backward([_rl_loop_datum(prompt, plain, 1.0)], "stable_reinforce").result()
    with pytest.raises(tinker.BadRequestError, match="unknown sequence_id 'seq-made-up'"):
        tc.forward_backward([_rl_loop_datum(prompt, res.sequences[0], 1.0, "seq-made-up")],
                            "stable_reinforce").result()
    bare = types.Datum(model_input=data[0].model_input, loss_fn_inputs=data[0].loss_fn_inputs)
    with pytest.raises(tinker.BadRequestError, match="datum 0: loss_fn stable_reinforce needs "
                                                     "provenance"):
        tc.forward_backward([bare], "stable_reinforce").result()
