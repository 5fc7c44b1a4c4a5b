import json

import pytest

from jaxrl.tokenizers import CharTokenizer, HFTokenizer, load_tokenizer

CHATML = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def test_char_roundtrip_and_specials():
    tok = CharTokenizer()
    text = "def f(x):\n\treturn x * 2  # ok!"
    ids = tok.encode(text)
    assert len(ids) == len(text) and tok.decode(ids) == text
    assert min(ids) > tok.bos_id and max(ids) < tok.vocab_size <= 128
    assert tok.decode(ids + [tok.eos_id] + tok.encode("junk")) == text
    assert tok.encode("a", add_bos=True)[0] == tok.bos_id
    with pytest.raises(ValueError, match="cannot encode character 'é'"):
        tok.encode("café")
    with pytest.raises(ValueError, match="outside the vocabulary"):
        tok.decode([999])
    assert tok.decode([*tok.encode("ab"), 120], errors="replace") == "ab\ufffd"
    assert isinstance(load_tokenizer(None), CharTokenizer)


@pytest.fixture
def hf_dir(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    from tokenizers import decoders

    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    corpus = ["the quick brown fox jumps over the lazy dog 12345"] * 50 + ["what is 2 + 3?"] * 50
    tok.train_from_iterator(corpus, trainer)
    tok.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
        "tokenizer_class": "PreTrainedTokenizerFast",
    }))
    return tmp_path


def test_hf_roundtrip_specials_and_chat_template_match_transformers(hf_dir):
    tok = HFTokenizer(hf_dir)
    text = "the lazy fox: what is 2 + 3?"
    assert tok.decode(tok.encode(text)) == text
    assert tok.eos_id == tok._tok.token_to_id("<|im_end|>")
    assert tok.pad_id == tok._tok.token_to_id("<|endoftext|>")
    msgs = [{"role": "user", "content": "what is 2 + 3?"}]
    import transformers

    ref = transformers.AutoTokenizer.from_pretrained(str(hf_dir))
    want = ref.apply_chat_template(msgs, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(msgs) == want
    assert tok.apply_chat_template(msgs, tokenize=True) == ref.encode(
        want, add_special_tokens=False
    )


def test_hf_errors(hf_dir, tmp_path):
    with pytest.raises(FileNotFoundError, match="tokenizer.json"):
        HFTokenizer(tmp_path / "missing")
    (hf_dir / "tokenizer_config.json").write_text(json.dumps({"eos_token": "<nope>"}))
    with pytest.raises(ValueError, match="eos_token '<nope>' is not in the vocabulary"):
        HFTokenizer(hf_dir)
