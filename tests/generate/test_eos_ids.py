"""Generation stops on every end-of-sequence id a checkpoint lists: the tokenizer's `eos_token`
and the `eos_token_id`s of its `generation_config.json` (Gemma's instruction-tuned checkpoints
list `[1, 106]`, 106 = `<end_of_turn>`), as `transformers.generate` does."""

import json

import pytest

from jaxrl.generate import SamplingParams, sample
from jaxrl.generate.api import encode_prompts
from jaxrl.testing import make_hf_model, tiny_tokenizer
from jaxrl.tokenizers import CharTokenizer, HFTokenizer, generation_eos_ids

TEXTS = ["the cat sat on the mat", "a dog ran in the park", "hello world, hello jax"]


def _write_generation_config(path, eos):
    (path / "generation_config.json").write_text(json.dumps({"bos_token_id": 1,
                                                             "eos_token_id": eos}))


def test_generation_stops_on_every_eos_id_of_generation_config(tmp_path):
    make_hf_model("llama", tmp_path, seed=4, vocab_size=300)
    tiny_tokenizer(tmp_path, TEXTS)
    tok = HFTokenizer(tmp_path)
    eos = tok.eos_id  # <|im_end|>
    greedy = SamplingParams(max_tokens=16, temperature=0.0)
    prompt = encode_prompts(["hello world"], tok)[0]
    # the reference: token-id prompts without eos ids run to max_tokens
    ref = sample(str(tmp_path), [prompt], greedy)[0].tokens
    assert len(ref) == 16 and eos not in ref
    # a second end id: a token greedy decoding first emits after the first one
    k = next(i for i in range(1, 16) if ref[i] not in ref[:i])
    _write_generation_config(tmp_path, [eos, ref[k]])  # as Gemma's [1, 106]
    assert HFTokenizer(tmp_path).eos_ids == (eos, ref[k])
    got = sample(str(tmp_path), ["hello world"], greedy)[0]  # the checkpoint's tokenizer
    assert got.tokens == ref[:k + 1] and got.finish_reason == "stop"


def test_eos_ids_read_from_every_generation_config_form(tmp_path):
    assert generation_eos_ids(tmp_path) == ()  # no file
    _write_generation_config(tmp_path, 7)
    assert generation_eos_ids(tmp_path) == (7,)
    _write_generation_config(tmp_path, [1, 106, 1])
    assert generation_eos_ids(tmp_path) == (1, 106)
    _write_generation_config(tmp_path, None)
    assert generation_eos_ids(tmp_path) == ()
    _write_generation_config(tmp_path, [1, "<end_of_turn>"])
    with pytest.raises(ValueError, match=r"eos_token_id must be a token id or a list of them, "
                                         r"got \[1, '<end_of_turn>'\]"):
        generation_eos_ids(tmp_path)
    assert CharTokenizer().eos_ids == (CharTokenizer().eos_id,)


def test_an_export_lists_every_eos_id():
    """The exported generation_config.json lists every id the run stopped on (one id stays an
    int, as transformers writes it)."""
    import types

    from jaxrl.config import RunConfig
    from jaxrl.train.export import generation_config

    cfg = RunConfig()
    gemma_it = types.SimpleNamespace(eos_id=1, eos_ids=(1, 106), pad_id=0, bos_id=2)
    assert generation_config(cfg, gemma_it)["eos_token_id"] == [1, 106]
    one = types.SimpleNamespace(eos_id=1, eos_ids=(1,), pad_id=0, bos_id=None)
    assert generation_config(cfg, one)["eos_token_id"] == 1
