"""Fixtures for tests and examples: the tiny model config, tiny Hugging Face models.

Production code never imports this module (tests/test_production_imports.py checks): the named
model shapes live in `jaxrl.presets`, re-exported here for the tests.

    python -m jaxrl.testing gsm8k-recipe runs/gsm8k-tiny   # a tiny model, tokenizer and GSM8K
                                                           # files for configs/gsm8k_tiny.py
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

from jaxrl.config import ModelConfig
from jaxrl.presets import tiny_model_config

__all__ = ["TINY_HF_KW", "make_gsm8k_recipe", "make_hf_model", "tiny_model_config",
           "tiny_tokenizer"]

TINY_HF_KW = dict(
    vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
    num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
    rms_norm_eps=1e-6, rope_theta=10000.0,
)


def make_hf_model(arch: str, path: str | Path | None = None, seed: int = 0, **overrides):
    """A tiny random `transformers` model of `arch` (llama | mistral | mixtral | olmo2 | phi3 |
    qwen2 | qwen3 | qwen3_moe), optionally saved.

    Weights are drawn with std 0.2 (not HF's 0.02) so logits vary enough for parity to mean much.
    """
    import torch
    import transformers

    kw = dict(TINY_HF_KW, **overrides)
    if arch == "llama":
        cfg = transformers.LlamaConfig(**kw)
        cls = transformers.LlamaForCausalLM
    elif arch == "mistral":
        cfg = transformers.MistralConfig(**dict(dict(sliding_window=None), **kw))
        cls = transformers.MistralForCausalLM
    elif arch == "mixtral":
        kw = dict(dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=None), **kw)
        cfg = transformers.MixtralConfig(**kw)
        cls = transformers.MixtralForCausalLM
    elif arch == "olmo2":
        cfg = transformers.Olmo2Config(**dict(dict(pad_token_id=0, eos_token_id=1), **kw))
        cls = transformers.Olmo2ForCausalLM
    elif arch == "phi3":
        kw = dict(dict(sliding_window=None, pad_token_id=0), **kw)
        cfg = transformers.Phi3Config(**kw)
        cls = transformers.Phi3ForCausalLM
    elif arch == "qwen2":
        cfg = transformers.Qwen2Config(**kw)
        cls = transformers.Qwen2ForCausalLM
    elif arch == "qwen3":
        kw.setdefault("head_dim", 16)
        cfg = transformers.Qwen3Config(**kw)
        cls = transformers.Qwen3ForCausalLM
    elif arch == "qwen3_moe":
        kw = dict(dict(head_dim=16, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=32), **kw)
        cfg = transformers.Qwen3MoeConfig(**kw)
        cls = transformers.Qwen3MoeForCausalLM
    else:
        raise ValueError(
            f"unknown arch {arch!r}; valid: ['llama', 'mistral', 'mixtral', 'olmo2', 'phi3', "
            "'qwen2', 'qwen3', 'qwen3_moe']")
    torch.manual_seed(seed)
    model = cls(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.copy_(1.0 + 0.1 * torch.randn_like(p))
            else:
                p.copy_(0.2 * torch.randn_like(p))
    if path is not None:
        model.save_pretrained(str(path), safe_serialization=True)
    return model


CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
GSM8K_STYLE = [("Nat sold {a} clips and then {b} more. How many clips?", "+"),
               ("Bo has {a} coins and gives away {b}. How many coins now?", "-"),
               ("A box holds {a} eggs. How many eggs are in {b} boxes?", "*")]


def tiny_tokenizer(path: str | Path, texts: list[str], vocab_size: int = 300) -> None:
    """A byte-level BPE `tokenizer.json` trained on `texts`, with a ChatML template and
    tokenizer_config.json, as a Hub repository ships them."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts) * 5, trainer)
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


LLAMA_CHAT = ("{{ bos_token }}{% for m in messages %}[{{ m['role'] }}] {{ m['content'] }}"
              "{{ eos_token }}{% endfor %}{% if add_generation_prompt %}[assistant] {% endif %}")


def tiny_llama_tokenizer(path: str | Path, texts: list[str], *, add_bos: bool = True,
                         chat_template: str | None = LLAMA_CHAT, vocab_size: int = 300) -> None:
    """A Llama-style `tokenizer.json` (`<s>` / `</s>` specials; with `add_bos`, a post-processor
    that puts `<s>` first and `add_bos_token: true` in tokenizer_config.json), as a Llama
    repository ships them."""
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=["<unk>", "<s>", "</s>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(list(texts) * 5, trainer)
    if add_bos:
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", pair="<s> $A <s> $B", special_tokens=[("<s>", 1)])
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    config = {"bos_token": "<s>", "eos_token": "</s>", "pad_token": "</s>",
              "add_bos_token": add_bos, "add_eos_token": False,
              "tokenizer_class": "PreTrainedTokenizerFast"}
    if chat_template is not None:
        config["chat_template"] = chat_template
    (path / "tokenizer_config.json").write_text(json.dumps(config))


def _save_tiny_qwen2(path: Path, *, seed: int, **overrides) -> None:
    """A random Qwen2 of `TINY_HF_KW`'s shape (untied, as `transformers`' Qwen2 default) written
    as a Hugging Face directory by jaxrl itself, so that the recipe needs neither torch nor
    `transformers` (a plain `pip install -e .`)."""
    from jaxrl.models import create_model
    from jaxrl.models.hf import save_pretrained

    kw = dict(TINY_HF_KW, **overrides)
    cfg = ModelConfig(
        architecture="qwen2", vocab_size=kw["vocab_size"], hidden_size=kw["hidden_size"],
        intermediate_size=kw["intermediate_size"], num_layers=kw["num_hidden_layers"],
        num_heads=kw["num_attention_heads"], num_kv_heads=kw["num_key_value_heads"],
        max_position_embeddings=kw["max_position_embeddings"], rms_norm_eps=kw["rms_norm_eps"],
        rope_theta=kw["rope_theta"], qkv_bias=True, tie_embeddings=False)
    save_pretrained(create_model(cfg, seed=seed), cfg, path)


def make_gsm8k_recipe(out: str | Path, *, train: int = 48, test: int = 16, seed: int = 0) -> Path:
    """`out/model` (a tiny random Qwen2 with its own BPE tokenizer) and `out/train.jsonl`,
    `out/test.jsonl` in GSM8K's format (question, answer with a final `#### N` line): what
    `configs/gsm8k_tiny.py` reads. Returns `out`. Needs only jaxrl's own dependencies."""
    rng = random.Random(seed)
    rows = []
    for _ in range(train + test):
        text, op = rng.choice(GSM8K_STYLE)
        a, b = rng.randint(2, 60), rng.randint(2, 9)
        value = {"+": a + b, "-": a - b, "*": a * b}[op]
        rows.append({"question": text.format(a=a, b=b),
                     "answer": f"{a} {op} {b} = <<{a}{op}{b}={value}>>{value}\n#### {value}"})
    out = Path(out)
    model_dir = out / "model"
    texts = [r["question"] + " " + r["answer"] for r in rows]
    tiny_tokenizer(model_dir, texts + ["Solve it step by step and put the final answer in "
                                       "\\boxed{}. The answer is 0123456789"])
    _save_tiny_qwen2(model_dir, seed=seed, vocab_size=320, max_position_embeddings=512)
    for name, part in (("train.jsonl", rows[:train]), ("test.jsonl", rows[train:])):
        (out / name).write_text("".join(json.dumps(r) + "\n" for r in part))
    return out


if __name__ == "__main__":
    import sys

    usage = ("usage: python -m jaxrl.testing gsm8k-recipe OUT_DIR\n"
             "  writes a tiny Qwen2 model, its BPE tokenizer and GSM8K-format train/test files")
    if sys.argv[1:] in (["-h"], ["--help"]):
        print(usage)
        raise SystemExit(0)
    if len(sys.argv) != 3 or sys.argv[1] != "gsm8k-recipe":
        raise SystemExit(usage)
    print(f"wrote {make_gsm8k_recipe(sys.argv[2])}: model/, train.jsonl, test.jsonl")
