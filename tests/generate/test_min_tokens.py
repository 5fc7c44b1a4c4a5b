"""`SamplingParams.min_tokens` and `ignore_eos`, on a tiny model whose EOS is all but certain."""

import jax
import numpy as np
import pytest

from jaxrl.generate import JaxEngine, SamplingParams, Scheduler
from jaxrl.models import create_model
from jaxrl.testing import tiny_model_config

EOS, STOP = 3, 9
PROMPT = [1, 2, EOS]  # the tiny model repeats the last token: EOS comes next with p ~ 0.9999


@pytest.fixture(scope="module")
def model():
    model = create_model(tiny_model_config(), seed=3)
    model.final_norm.weight[...] = model.final_norm.weight[...] * 30  # sharpen every logit
    return model


@pytest.fixture(scope="module")
def engine(model):
    return JaxEngine(model, num_slots=4, max_len=32, chunk_steps=4, max_stop_ids=4,
                     eos_ids=(EOS,))


def _run(engine, **kw):
    sched = Scheduler(engine)
    sched.submit(PROMPT, SamplingParams(max_tokens=10, stop_token_ids=[STOP], **kw))
    return sorted(sched.run(), key=lambda c: c.sample_index)


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_eos_is_what_the_model_says_first(engine, temperature):
    """The premise: without the options every sample is the EOS alone."""
    out = _run(engine, temperature=temperature, n=4)
    assert [(c.tokens, c.finish_reason) for c in out] == [([EOS], "stop")] * 4


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_ignore_eos_generates_to_max_tokens(engine, temperature):
    out = _run(engine, temperature=temperature, n=4, ignore_eos=True)
    for c in out:
        assert c.finish_reason == "length" and c.num_tokens == 10, c
        assert EOS in c.tokens  # EOS was sampled, not banned: it just does not stop
        assert STOP not in c.tokens[:-1]  # an explicit stop id still stops


@pytest.mark.parametrize("temperature", [0.0, 1.0])
def test_min_tokens_bans_eos_and_stop_ids_before_the_minimum(model, engine, temperature):
    out = _run(engine, temperature=temperature, n=4, min_tokens=5)
    for c in out:
        assert not {EOS, STOP} & set(c.tokens[:5]), c.tokens
        assert c.num_tokens > 5, c
        if c.finish_reason == "stop":
            assert c.tokens[-1] in (EOS, STOP) and not {EOS, STOP} & set(c.tokens[:-1])
    # the behaviour logprob is under the distribution sampled from: EOS and STOP masked
    logits = np.asarray(model(np.array([PROMPT]))[0, -1], np.float64)
    logits[[EOS, STOP]] = -np.inf
    expected = np.asarray(jax.nn.log_softmax(logits))
    for c in out:
        np.testing.assert_allclose(c.logprobs[0], expected[c.tokens[0]], atol=2e-3)


def test_min_tokens_counts_from_the_first_token(engine):
    """min_tokens=1 bans EOS only at the first token; afterwards the model may stop."""
    (c,) = _run(engine, temperature=0.0, min_tokens=1)
    assert c.tokens[0] != EOS and c.num_tokens >= 2


@pytest.mark.parametrize("kw", [dict(min_tokens=-1), dict(min_tokens=11), dict(min_tokens=2.0),
                                dict(ignore_eos="yes")])
def test_bad_values_are_clear_errors(kw):
    with pytest.raises(ValueError, match="min_tokens|ignore_eos"):
        SamplingParams(max_tokens=10, **kw)


def test_the_run_config_drives_the_rollouts_sampling():
    from jaxrl.config import ConfigError, RunConfig, apply_overrides
    from jaxrl.rl.rollout import RolloutProducer, producer_config

    cfg = apply_overrides(RunConfig(), ["--generate.min_tokens=4", "--generate.ignore_eos=true",
                                        "--data.max_new_tokens=16"])
    pc = producer_config(cfg, prompts_per_step=2, process_index=0)
    producer = RolloutProducer.__new__(RolloutProducer)  # only its sampling settings are used
    producer.cfg = pc
    sp = producer._sampling(step=0, round_=0, slot=0)
    assert (sp.min_tokens, sp.ignore_eos, sp.max_tokens) == (4, True, 16)
    with pytest.raises(ConfigError, match="generate.min_tokens"):
        apply_overrides(cfg, ["--generate.min_tokens=-1"])
    with pytest.raises(ConfigError, match="generate.min_tokens=17 is more than data.max_new"):
        apply_overrides(cfg, ["--generate.min_tokens=17"])
