"""Models and tokenizers by local path or Hugging Face Hub id (`Qwen/Qwen2.5-0.5B-Instruct`).

`resolve(ref)` returns a local directory: `ref` itself when it exists; else, for a Hub id, the
snapshot in the Hugging Face cache (`HF_HOME`, default `~/.cache/huggingface`, as
`huggingface-cli download` and `transformers` lay it out); else, when the machine is online
(`HF_HUB_OFFLINE` unset), a download into that cache of the files jaxrl reads (config, safetensors
weights, tokenizer files; not `.bin`/`.pt` duplicates). Offline and not cached, it raises a
`ConfigError` that says how to fetch the model.

`huggingface_hub` comes with `tokenizers` (a core dependency); it is imported only here.
"""

from __future__ import annotations

import os
import re
from pathlib import Path

from jaxrl.config import ConfigError

# the files a run needs: config + weights + tokenizer (+ chat template, generation config)
DOWNLOAD_PATTERNS = ("*.json", "*.safetensors", "*.jinja", "*.txt", "*.model", "*.tiktoken")
_REPO_ID = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*/[A-Za-z0-9][A-Za-z0-9_.-]*$")
_TRUE = ("1", "true", "yes", "on")


def is_hub_id(ref: str) -> bool:
    """`org/name` with the characters the Hub allows (a plain `name` is taken as a path)."""
    return bool(_REPO_ID.match(str(ref))) and ".." not in str(ref)


def offline() -> bool:
    """`HF_HUB_OFFLINE` (or `TRANSFORMERS_OFFLINE`) is set: the cache only, no download."""
    return any(os.environ.get(k, "").strip().lower() in _TRUE
               for k in ("HF_HUB_OFFLINE", "TRANSFORMERS_OFFLINE"))


def cache_dir() -> str:
    from huggingface_hub import constants

    return str(constants.HF_HUB_CACHE)


def _how_to_fetch(ref: str) -> str:
    return (f"fetch it on a machine with network (`huggingface-cli download {ref}`, or "
            f"`hf download {ref}`) and copy that Hugging Face cache here (or point HF_HOME at "
            f"it), or pass a local directory that holds its config.json and *.safetensors")


def resolve(ref: str | Path, *, what: str = "init", need: str = "config.json",
            download: bool | None = None) -> Path:
    """The local directory of model (or tokenizer) `ref`, which must hold the file `need`.

    `what` names the setting in errors (`init`, `tokenizer`, ...). `download=None` downloads
    only when the machine is not marked offline.
    """
    text = str(ref)
    path = Path(text).expanduser()
    if path.exists():
        if path.is_dir() and need and not (path / need).is_file():
            raise ConfigError(
                f"{what}={text!r}: the directory {path} has no {need}; expected a Hugging Face "
                f"model directory (config.json, *.safetensors, tokenizer.json)")
        return path
    if not is_hub_id(text):
        raise ConfigError(
            f"{what}={text!r}: no such directory, and not a Hugging Face Hub id (org/name, e.g. "
            f"Qwen/Qwen2.5-0.5B-Instruct)")
    try:
        import huggingface_hub
        from huggingface_hub.errors import HFValidationError, LocalEntryNotFoundError
    except ImportError:  # pragma: no cover - it ships with `tokenizers`
        raise ConfigError(f"{what}={text!r} looks like a Hub id, but huggingface_hub is not "
                          "installed (pip install huggingface_hub)") from None
    try:
        snap = Path(huggingface_hub.snapshot_download(text, local_files_only=True))
    except HFValidationError as e:
        raise ConfigError(f"{what}={text!r} is not a valid Hugging Face Hub id: {e}") from None
    except (LocalEntryNotFoundError, FileNotFoundError):
        snap = None
    if snap is not None and (not need or (snap / need).is_file()):
        return snap
    where = (f"its cached snapshot {snap} has no {need}" if snap is not None
             else f"it is not in the Hugging Face cache ({cache_dir()})")
    if download is None:
        download = not offline()
    if not download:
        raise ConfigError(
            f"{what}={text!r}: {where}, and this machine is offline (HF_HUB_OFFLINE is set); "
            + _how_to_fetch(text))
    try:
        snap = Path(huggingface_hub.snapshot_download(text, allow_patterns=list(DOWNLOAD_PATTERNS)))
    except Exception as e:  # noqa: BLE001 - network, auth, missing repo: one clear message
        raise ConfigError(
            f"{what}={text!r}: {where}, and downloading it failed ({type(e).__name__}: "
            f"{str(e).splitlines()[0] if str(e) else ''}); {_how_to_fetch(text)}") from None
    if need and not (snap / need).is_file():
        raise ConfigError(f"{what}={text!r}: the Hub repository has no {need}")
    return snap
