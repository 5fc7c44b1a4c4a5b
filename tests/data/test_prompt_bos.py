"""Prompts through an HF tokenizer get BOS exactly when, and as often as, `transformers` would
give it: Llama-style tokenizers (add_bos_token) get one, ChatML ones without BOS get none."""

import pytest

from jaxrl.data.tasks import Task, encode_prompt
from jaxrl.generate.api import encode_prompts
from jaxrl.testing import LLAMA_CHAT, tiny_llama_tokenizer, tiny_tokenizer
from jaxrl.tokenizers import CharTokenizer, HFTokenizer

TEXTS = ["Nat sold 48 clips.", "How many clips?", "hello world", "[user] [assistant]"]
TEXT = "How many clips?"
MESSAGES = [{"role": "user", "content": TEXT}]
TASK = Task("t", lambda split: [], lambda r, chat: "", lambda r: r["prompt"], rewards={})


def _transformers(path):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(str(path))


def _chat_ids(hf, messages):
    out = hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    return list(out["input_ids"] if hasattr(out, "keys") else out)


@pytest.mark.parametrize("add_bos", [True, False])
def test_llama_style_prompts_equal_transformers(tmp_path, add_bos):
    tiny_llama_tokenizer(tmp_path, TEXTS, add_bos=add_bos)
    ours, hf = HFTokenizer(tmp_path), _transformers(tmp_path)
    assert ours.bos_id == hf.bos_token_id and ours.add_bos == add_bos
    plain = TASK.render({"prompt": TEXT}, ours, "plain")
    assert plain == hf(TEXT).input_ids
    assert plain.count(ours.bos_id) == (1 if add_bos else 0)
    # the template writes BOS itself: exactly one, never two
    chat = TASK.render({"prompt": TEXT}, ours, "chat")
    assert chat == _chat_ids(hf, MESSAGES) and chat.count(ours.bos_id) == 1
    assert encode_prompts([TEXT], ours) == [plain]
    assert encode_prompts([TEXT], ours, chat=True) == [chat]


def test_a_template_without_bos_still_gets_one(tmp_path):
    """add_bos_token with a template that does not write BOS: the rendered text is encoded the
    way `transformers` encodes text (`tokenizer(text)`), BOS first."""
    tiny_llama_tokenizer(tmp_path, TEXTS, chat_template=LLAMA_CHAT.replace("{{ bos_token }}", ""))
    ours, hf = HFTokenizer(tmp_path), _transformers(tmp_path)
    text = ours.apply_chat_template(MESSAGES)
    assert encode_prompt(ours, MESSAGES) == hf(text).input_ids
    assert encode_prompt(ours, MESSAGES).count(ours.bos_id) == 1


def test_tokenizers_without_bos_get_none(tmp_path):
    tiny_tokenizer(tmp_path, TEXTS)  # ChatML, no bos_token (Qwen-style)
    ours, hf = HFTokenizer(tmp_path), _transformers(tmp_path)
    assert ours.bos_id is None and not ours.add_bos
    assert TASK.render({"prompt": TEXT}, ours, "plain") == hf(TEXT).input_ids
    assert TASK.render({"prompt": TEXT}, ours, "chat") == _chat_ids(hf, MESSAGES)


def test_char_tokenizer_prompts_start_with_bos_once():
    tok = CharTokenizer()
    assert TASK.render({"prompt": "1+1="}, tok) == [tok.bos_id, *tok.encode("1+1=")]
    assert encode_prompts(["1+1="], tok) == [[tok.bos_id, *tok.encode("1+1=")]]
