"""Tokenizers: a built-in character tokenizer for synthetic tasks, and Hugging Face `tokenizers`.

Both implement the same small interface: `encode`, `decode`, `eos_id`, `eos_ids`, `pad_id`,
`vocab_size`, `bos_id` (None without one) and `add_bos` (and `apply_chat_template` where a
template exists). `eos_id` is the one id a demonstration ends with; `eos_ids` every id that ends
generation: `eos_id` and, for a Hugging Face directory, the `eos_token_id`s its
`generation_config.json` lists (Gemma's instruction-tuned checkpoints: `[1, 106]`, 106 =
`<end_of_turn>`), as `transformers.generate` stops on them.
`jaxrl.data.tasks.encode_prompt` turns a prompt (text, or chat messages) into the ids a model is
given: BOS first exactly once when the tokenizer adds one, as `transformers` does for text.
"""

from __future__ import annotations

import json
import string
import sys
from pathlib import Path
from typing import Protocol

import jinja2
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer as _HF

from jaxrl.config import ConfigError


class Tokenizer(Protocol):
    eos_id: int
    eos_ids: tuple[int, ...]
    pad_id: int
    vocab_size: int

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: list[int]) -> str: ...


class CharTokenizer:
    """One token per character: ids 0..2 are <pad>, <eos>, <bos>; then printable ASCII + \\n, \\t.

    Unknown characters are an error (they would otherwise vanish silently from prompts).
    """

    SPECIALS = ("<pad>", "<eos>", "<bos>")
    CHARS = string.printable[:95] + "\n\t"  # digits, letters, punctuation, space, \n, \t

    add_bos = True  # prompts start with <bos>

    def __init__(self):
        self.pad_id, self.eos_id, self.bos_id = 0, 1, 2
        self.eos_ids = (self.eos_id,)
        self._to_id = {c: i + len(self.SPECIALS) for i, c in enumerate(self.CHARS)}
        self._to_char = {i: c for c, i in self._to_id.items()}
        self.vocab_size = len(self.SPECIALS) + len(self.CHARS)

    def encode(self, text: str, add_bos: bool = False) -> list[int]:
        try:
            ids = [self._to_id[c] for c in text]
        except KeyError as e:
            raise ValueError(
                f"CharTokenizer cannot encode character {e.args[0]!r}; it knows printable "
                f"ASCII, newline and tab"
            ) from None
        return [self.bos_id, *ids] if add_bos else ids

    def decode(self, ids: list[int], stop_at_eos: bool = True, errors: str = "strict") -> str:
        """Text of `ids` up to EOS. Ids outside the vocabulary raise, or with
        `errors="replace"` become U+FFFD (a model's padded vocabulary can sample them)."""
        out = []
        for i in ids:
            i = int(i)
            if i == self.eos_id and stop_at_eos:
                break
            if i in self._to_char:
                out.append(self._to_char[i])
            elif not 0 <= i < self.vocab_size:
                if errors == "replace":
                    out.append("\ufffd")
                    continue
                raise ValueError(f"token id {i} is outside the vocabulary [0, {self.vocab_size})")
        return "".join(out)


def _token_text(entry) -> str | None:
    if entry is None or isinstance(entry, str):
        return entry
    return entry.get("content")


class HFTokenizer:
    """`tokenizer.json` (+ `tokenizer_config.json` for specials and the chat template)."""

    def __init__(self, path: str | Path):
        path = Path(path)
        file = path / "tokenizer.json" if path.is_dir() else path
        if not file.is_file():
            raise FileNotFoundError(f"{path}: no tokenizer.json found")
        self._tok = _HF.from_file(str(file))
        cfg_file = file.parent / "tokenizer_config.json"
        self.config = json.loads(cfg_file.read_text()) if cfg_file.is_file() else {}
        self.chat_template = self.config.get("chat_template")
        tpl_file = file.parent / "chat_template.jinja"
        if self.chat_template is None and tpl_file.is_file():
            self.chat_template = tpl_file.read_text()
        self.eos_token = _token_text(self.config.get("eos_token"))
        self.pad_token = _token_text(self.config.get("pad_token")) or self.eos_token
        self.bos_token = _token_text(self.config.get("bos_token"))
        self.eos_id = self._id_of(self.eos_token, "eos_token")
        self.eos_ids = (self.eos_id,) + tuple(
            i for i in generation_eos_ids(file.parent) if i != self.eos_id)
        self.pad_id = self._id_of(self.pad_token, "pad_token")
        self.bos_id = self._tok.token_to_id(self.bos_token) if self.bos_token else None
        self.add_bos = self.bos_id is not None and self._adds_bos()
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)

    def _adds_bos(self) -> bool:
        """Whether `transformers` puts BOS before a text: `add_bos_token` in the config (Llama's
        tokenizers), else what tokenizer.json's post-processor does."""
        if "add_bos_token" in self.config:
            return bool(self.config["add_bos_token"])
        with_specials = self._tok.encode("a", add_special_tokens=True).ids
        return with_specials[:1] == [self.bos_id] != self._tok.encode("a").ids[:1]

    def _id_of(self, token: str | None, what: str) -> int:
        if token is None:
            raise ValueError(f"tokenizer_config.json has no {what}; cannot pick an id for it")
        tid = self._tok.token_to_id(token)
        if tid is None:
            raise ValueError(f"{what} {token!r} is not in the vocabulary")
        return tid

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return self._tok.encode(text, add_special_tokens=add_special_tokens).ids

    def decode(self, ids: list[int], skip_special_tokens: bool = True, errors: str = "replace"
               ) -> str:
        ids = [int(i) for i in ids]
        if errors == "replace":  # ids past the tokenizer's vocabulary (padded embedding rows)
            ids = [i for i in ids if 0 <= i < self.vocab_size]
        return self._tok.decode(ids, skip_special_tokens=skip_special_tokens)

    def apply_chat_template(
        self, messages: list[dict], add_generation_prompt: bool = True, tokenize: bool = False
    ):
        """Render `messages` with the tokenizer's Jinja chat template."""
        if not self.chat_template:
            raise ValueError("this tokenizer has no chat_template; pass plain text instead")
        def raise_exception(message):
            raise jinja2.exceptions.TemplateError(message)

        env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True)
        env.globals["raise_exception"] = raise_exception
        env.filters["tojson"] = lambda x, **kw: json.dumps(x, ensure_ascii=False, **kw)
        text = env.from_string(self.chat_template).render(
            messages=messages, add_generation_prompt=add_generation_prompt,
            bos_token=self.bos_token or "", eos_token=self.eos_token or "",
        )
        return self.encode(text) if tokenize else text


def generation_eos_ids(directory: str | Path) -> tuple[int, ...]:
    """The `eos_token_id`s of `directory/generation_config.json` (an int or a list; none when
    the file or the key is absent), in its order without repeats."""
    file = Path(directory) / "generation_config.json"
    if not file.is_file():
        return ()
    value = json.loads(file.read_text()).get("eos_token_id")
    ids = [] if value is None else value if isinstance(value, list) else [value]
    if not all(isinstance(i, int) and not isinstance(i, bool) and i >= 0 for i in ids):
        raise ValueError(f"{file}: eos_token_id must be a token id or a list of them, got "
                         f"{value!r}")
    return tuple(dict.fromkeys(ids))


def load_tokenizer(path: str | Path | None, init: str | Path | None = None) -> Tokenizer:
    """The tokenizer a setting names.

    `None` or `"char"`: the CharTokenizer. `"auto"`: the tokenizer of the model `init` (its
    `tokenizer.json`), or the CharTokenizer when there is no `init`. Otherwise a local tokenizer
    directory (or `tokenizer.json` file) or a Hugging Face Hub id, resolved through the local
    Hugging Face cache (`jaxrl.models.hub.resolve`). A bad value raises `ConfigError`.
    """
    text = "char" if path is None else str(path)
    if text == "char":
        return CharTokenizer()
    if text == "auto":
        if init is None:
            return CharTokenizer()
        from jaxrl.models.hub import resolve

        model_dir = resolve(init, what="init")
        if not (model_dir / "tokenizer.json").is_file():
            raise ConfigError(
                f"tokenizer='auto' uses the model's own tokenizer, but init={str(init)!r} has no "
                f"tokenizer.json ({model_dir}); set --tokenizer to a tokenizer directory or Hub "
                "id, or --tokenizer=char for jaxrl's character tokenizer")
        return HFTokenizer(model_dir)
    if not Path(text).expanduser().exists():
        from jaxrl.models.hub import resolve

        return HFTokenizer(resolve(text, what="tokenizer", need="tokenizer.json"))
    try:
        return HFTokenizer(Path(text).expanduser())
    except FileNotFoundError as e:
        raise ConfigError(f"tokenizer={text!r}: {e}; valid: 'auto', 'char', a directory with "
                          "tokenizer.json, or a Hugging Face Hub id") from None


def model_tokenizer(model_dir: str | Path, tokenizer: str | None = None,
                    what: str = "--model") -> Tokenizer:
    """The tokenizer for a model directory: `tokenizer` when given, else the directory's own
    `tokenizer.json`, else the CharTokenizer, with a line on stderr saying so (a real model's
    text would come out as nonsense, and nothing else would tell why)."""
    if tokenizer:
        return load_tokenizer(tokenizer)
    if (Path(model_dir) / "tokenizer.json").is_file():
        return HFTokenizer(Path(model_dir))
    print(f"--- {what} {model_dir} has no tokenizer.json: using jaxrl's character tokenizer "
          "(--tokenizer names another directory or Hub id)", file=sys.stderr)
    return CharTokenizer()
