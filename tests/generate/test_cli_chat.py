"""Text prompts and chat: `python -m jaxrl.generate --chat` and `sample(model, ["text"], ...)`.

Before: the chat template's rendered text went to the engine as if it were token ids (`invalid
literal for int()`), and `sample` with a string prompt failed the same way."""

import json

import pytest

from jaxrl.generate import SamplingParams, sample
from jaxrl.generate.__main__ import main
from jaxrl.testing import make_hf_model
from jaxrl.tokenizers import HFTokenizer

CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GREEDY = SamplingParams(max_tokens=4, temperature=0.0)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """A tiny Qwen2 with a byte-level BPE tokenizer and a ChatML template in one directory."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    path = tmp_path_factory.mktemp("chat_model")
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=280, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(["user assistant: what is 2 + 3? hello there"] * 20, trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML}))
    make_hf_model("qwen2", path, vocab_size=288)
    return path


@pytest.fixture(scope="module")
def engine(model_dir):
    from jaxrl.generate.engine import JaxEngine
    from jaxrl.models import load_pretrained

    _, model = load_pretrained(model_dir)
    return JaxEngine(model, num_slots=1, max_len=32, eos_ids=[HFTokenizer(model_dir).eos_id])


CHAT_TEXT = "<|im_start|>user\nwhat is 2 + 3?<|im_end|>\n<|im_start|>assistant\n"


@pytest.mark.slow
def test_chat_cli_encodes_the_rendered_template(model_dir, engine, capsys):
    assert main(["--model", str(model_dir), "--prompt", "what is 2 + 3?", "--chat",
                 "--max-tokens", "4", "--logprobs"]) == 0
    out = capsys.readouterr().out
    assert "--- prompt 0 sample 0" in out
    # the same greedy tokens as the hand-written ChatML prompt, encoded with its specials
    tok = HFTokenizer(model_dir)
    ids = tok.encode(CHAT_TEXT)
    assert ids[0] == tok._tok.token_to_id("<|im_start|>")  # a special, one id
    want = sample(engine, [ids], GREEDY)
    assert f"tokens: {want[0].tokens}" in out
    # a checkpoint path brings its own tokenizer (and EOS id); one string is one prompt
    by_path = sample(str(model_dir), "hello there", GREEDY)
    assert by_path[0].tokens == sample(engine, [tok.encode("hello there")], GREEDY)[0].tokens


def test_sample_takes_text_prompts(model_dir, engine):
    tok = HFTokenizer(model_dir)
    ids = sample(engine, [tok.encode("hello there")], GREEDY)
    text = sample(engine, ["hello there"], GREEDY, tokenizer=tok)
    assert [c.tokens for c in text] == [c.tokens for c in ids]
    chat = sample(engine, ["what is 2 + 3?"], GREEDY, tokenizer=tok, chat=True)
    want = sample(engine, [tok.encode(CHAT_TEXT)], GREEDY)
    assert [c.tokens for c in chat] == [c.tokens for c in want]
    assert len(want[0].tokens) >= 1


def test_text_prompts_without_a_tokenizer_say_so(engine):
    with pytest.raises(TypeError, match="text prompts need a tokenizer"):
        sample(engine, ["hello"], GREEDY)
    with pytest.raises(TypeError, match="chat=True takes text prompts"):
        sample(engine, [[1, 2]], GREEDY, chat=True)
