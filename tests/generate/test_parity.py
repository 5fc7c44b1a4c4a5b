"""Generation vs `transformers` greedy decoding and vs teacher-forced log-probabilities."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
from flax import nnx

from jaxrl.generate import JaxEngine, SamplingParams, sample
from jaxrl.models import load_pretrained
from jaxrl.testing import make_hf_model

PROMPTS = [[5, 17, 3], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [42], list(range(20, 58))]
NEW = 12


@pytest.fixture(scope="module", params=["llama", "qwen2"])
def hf_and_ours(request, tmp_path_factory):
    path = tmp_path_factory.mktemp(request.param)
    hf = make_hf_model(request.param, path, seed=1)
    _, model = load_pretrained(path)
    # One engine per model: every test reuses its compiled prefill / insert / decode functions.
    return hf, model, JaxEngine(model, num_slots=8, max_len=64, chunk_steps=8)


def _hf_greedy(hf, prompt, eos=None):
    with torch.no_grad():
        out = hf.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt)),
                          max_new_tokens=NEW, do_sample=False, eos_token_id=eos,
                          pad_token_id=0)
    return out[0, len(prompt):].tolist()


@nnx.jit
def _forward(model, seq_1T):
    return model(seq_1T)[0]


def _teacher_forced_logits(model, seq):
    """Full causal forward pass, padded at the end to 64 tokens (one compile)."""
    padded = np.zeros((1, 64), np.int32)
    padded[0, : len(seq)] = seq
    return np.asarray(_forward(model, jnp.asarray(padded)))[: len(seq)]


def _teacher_forced_logprobs(model, prompt, tokens):
    logp = jax.nn.log_softmax(_teacher_forced_logits(model, prompt + tokens), axis=-1)
    pos = np.arange(len(prompt) - 1, len(prompt) - 1 + len(tokens))
    return np.asarray(logp[pos, np.asarray(tokens)])


def test_greedy_equals_transformers_with_mixed_prompt_lengths(hf_and_ours):
    hf, _, engine = hf_and_ours
    got = sample(engine, PROMPTS, SamplingParams(max_tokens=NEW, temperature=0.0))
    for prompt, c in zip(PROMPTS, got, strict=True):
        assert c.tokens == _hf_greedy(hf, prompt), f"prompt of length {len(prompt)}"
        assert c.finish_reason == "length"


def test_greedy_stops_on_eos_like_transformers(hf_and_ours):
    hf, _, engine = hf_and_ours
    prompt = PROMPTS[1]
    eos = _hf_greedy(hf, prompt)[4]  # a token greedy decoding reaches
    want = _hf_greedy(hf, prompt, eos=eos)
    (c,) = sample(engine, [prompt],
                  SamplingParams(max_tokens=NEW, temperature=0.0, stop_token_ids=[eos]))
    assert c.tokens == want and c.tokens[-1] == eos and c.finish_reason == "stop"


def test_logprobs_equal_teacher_forced_forward(hf_and_ours):
    _, model, engine = hf_and_ours
    got = sample(engine, PROMPTS, SamplingParams(max_tokens=NEW, temperature=1.0, n=2, seed=3))
    for i, c in enumerate(got):
        prompt = PROMPTS[i // 2]
        ref = _teacher_forced_logprobs(model, prompt, c.tokens)
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4, rtol=0)


def test_logprobs_under_transformed_distribution(hf_and_ours):
    from transformers import TemperatureLogitsWarper, TopKLogitsWarper, TopPLogitsWarper

    _, model, engine = hf_and_ours
    sp = SamplingParams(max_tokens=NEW, temperature=0.7, top_k=20, top_p=0.8, seed=11)
    for prompt, c in zip(PROMPTS, sample(engine, PROMPTS, sp), strict=True):
        logits = _teacher_forced_logits(model, prompt + c.tokens)
        x = torch.tensor(logits[len(prompt) - 1: len(prompt) - 1 + NEW])
        for proc in (TemperatureLogitsWarper(0.7), TopKLogitsWarper(20), TopPLogitsWarper(0.8)):
            x = proc(None, x)
        ref = torch.log_softmax(x, -1)[torch.arange(NEW), torch.tensor(c.tokens)].numpy()
        assert np.all(np.isfinite(ref)), "sampled a token outside the top-k/top-p set"
        np.testing.assert_allclose(c.logprobs, ref, atol=1e-4, rtol=0)
