"""Turn the offline cache's random model (examples/cookbook_offline_cache.py) into a bigram
model that answers tinker-cookbook's math prompts in the expected form, `\\boxed{<digit>}` then
the `role_colon` stop string `\\n\\nUser:`, with a random digit, 2 or 3 (the recipes test asks
only the cache's gsm8k questions whose answer is 2 or 3): each sample is right with
probability 1/2, so a group of 4 has rewards that differ but in 1 case of 8, and the RL recipes
train, unchanged. (Digits 2..5 against answers 2..8 left every group of a 4-group batch all
wrong in some runs: a zero gradient, and a flaky test.)

How: both layers' attention and MLP outputs are zeroed (`o_proj`, `down_proj`), so the last
hidden state is the current token's embedding; each token of the chain gets its own embedding
axis and an untied `lm_head` holds the next-token logits per axis. Any other token has a zero
embedding, hence uniform logits."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
from safetensors.numpy import load_file, save_file

HIGH = 30.0  # a logit gap that makes a transition certain in practice
# (this token, {next token: weight}); weights are probabilities among the named ones
CHAIN = [(":", {" ": 1}), (" ", {"\\": 1}), ("\\", {"b": 1}), ("b", {"o": 1}), ("o", {"x": 1}),
         ("x", {"e": 1}), ("e", {"d": 0.98, "r": 0.02}), ("d", {"{": 1}),
         ("{", {"2": 0.5, "3": 0.5}),
         *[(str(k), {"}": 1}) for k in range(10)],
         ("}", {"\n": 1}), ("\n", {"\n": 0.6, "U": 0.4}), ("U", {"s": 1}), ("s", {"e": 1}),
         ("r", {":": 1})]


def byte_id(vocab: dict[str, int], ch: str) -> int:
    """The id of a one-byte token in a GPT-2 byte-level vocabulary."""
    return vocab[_byte_char(ord(ch))]


def _byte_char(b: int) -> str:
    """GPT-2's byte -> printable character table (what ByteLevel tokenizers spell bytes as)."""
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(
        range(ord("®"), ord("ÿ") + 1))
    cs, n = bs[:], 0
    for c in range(256):
        if c not in bs:
            bs.append(c)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))[b]


def make_bigram(model_dir: Path) -> None:
    cfg = json.loads((model_dir / "config.json").read_text())
    w = load_file(str(model_dir / "model.safetensors"))
    vocab = json.loads((model_dir / "tokenizer.json").read_text())["model"]["vocab"]
    v, d = w["model.embed_tokens.weight"].shape
    assert len(CHAIN) <= d, (len(CHAIN), d)
    embed, head = np.zeros((v, d), np.float32), np.zeros((v, d), np.float32)
    scale = np.sqrt(d)  # RMSNorm maps 10 * e_i to sqrt(d) * e_i
    for axis, (tok, nxt) in enumerate(CHAIN):
        embed[byte_id(vocab, tok), axis] = 10.0
        for ch, p in nxt.items():
            head[byte_id(vocab, ch), axis] = (HIGH + np.log(p)) / scale
    w["model.embed_tokens.weight"], w["lm_head.weight"] = embed, head
    w["model.norm.weight"] = np.ones(d, np.float32)
    for k in w:
        if k.endswith(("o_proj.weight", "down_proj.weight")):
            w[k] = np.zeros_like(w[k])
    save_file(w, str(model_dir / "model.safetensors"))
    cfg["tie_word_embeddings"] = False
    (model_dir / "config.json").write_text(json.dumps(cfg, indent=2))
