"""Saved weights and sampling sessions on disk, so they outlive the server process.

Layout under the server's state directory (`--state-dir`):

    weights/<model_id>/<kind>/<name>.npz   one saved state or sampler weights (kind: "weights" |
                                           "sampler_weights"), addressed as
                                           tinker://<model_id>/<kind>/<name>
    weights/<model_id>/external_weights/<name>/  a PEFT adapter directory (or a Hugging Face
                                           model's, full parameters): save_weights_external
    weights/<model_id>/<kind>/<name>.json  the checkpoint's record: when it was saved, when it
                                           expires (ttl_seconds), public, user metadata
                                           (`jaxrl.service.checkpoints`)
    samplers/<session_id>.json             the weights path a sampling session samples from (and
                                           the owner that made it, when keys are set)
    runs/<model_id>.json                   a training client's user_metadata (create_model)
    owners/<model_id>.json                 the owner of a training client, and so of every weights
                                           path under tinker://<model_id>/ (when keys are set)

Every file is written whole or not at all: to a temporary name in the same directory, flushed and
fsynced, renamed over the final name (`os.replace` is atomic on POSIX), and the directory fsynced so
the rename itself survives a crash. A reader therefore sees the old file, the new file, or no file,
never a torn one. An `.npz` holds the arrays by their pytree path (`adapters/...`, `mu/...`,
`nu/...`) and a JSON `meta` entry (base model, LoRA config, optimiser step).
"""

from __future__ import annotations

import io
import json
import os
import re
import shutil
import tempfile
from pathlib import Path

import jax
import numpy as np

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# model ids also take ':': the SDK names a client made from a saved state itself,
# `<session_id>:train:<model_seq_id>` (create_training_client_from_state)
_MODEL_ID = re.compile(r"[A-Za-z0-9][A-Za-z0-9._:-]{0,127}")
KINDS = ("weights", "sampler_weights", "external_weights")
EXTERNAL = "external_weights"  # a directory of files, not an .npz


class BadPath(ValueError):
    """A tinker:// path or name this server never writes (also: no escaping the state dir)."""


def check_name(name: str, what: str = "name") -> str:
    if not isinstance(name, str) or not _NAME.fullmatch(name) or ".." in name:
        raise BadPath(f"{what} {name!r} must be 1-128 characters of letters, digits, '.', '_' "
                      "or '-', starting with a letter or digit")
    return name


def check_model_id(model_id: str) -> str:
    if not isinstance(model_id, str) or not _MODEL_ID.fullmatch(model_id) or ".." in model_id:
        raise BadPath(f"model_id {model_id!r} must be 1-128 characters of letters, digits, '.', "
                      "'_', ':' or '-', starting with a letter or digit")
    return model_id


def parse_path(path: str) -> tuple[str, str, str]:
    """`tinker://<model_id>/<kind>/<name>` -> (model_id, kind, name)."""
    parts = path.removeprefix("tinker://").split("/") if path.startswith("tinker://") else []
    if len(parts) != 3 or parts[1] not in KINDS:
        raise BadPath(f"weights path {path!r} is not tinker://<model_id>/<kind>/<name> with kind "
                      f"in {KINDS}")
    return check_model_id(parts[0]), parts[1], check_name(parts[2])


def atomic_write(path: Path, data: bytes) -> None:
    """Write `data` to `path` so that a crash leaves the old file or the new one, never a mix."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        Path(tmp).unlink(missing_ok=True)
        raise
    dfd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dfd)
    finally:
        os.close(dfd)


def _flat(prefix: str, tree) -> dict[str, np.ndarray]:
    leaves = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + jax.tree_util.keystr(p): np.asarray(v) for p, v in leaves}


def _unflat(prefix: str, arrays: dict, like):
    """Rebuild `like`'s structure from `arrays` (keys must match exactly)."""
    paths, treedef = jax.tree_util.tree_flatten_with_path(like)
    keys = [prefix + jax.tree_util.keystr(p) for p, _ in paths]
    have = {k for k in arrays if k.startswith(prefix)}
    if have != set(keys):
        raise ValueError(f"saved {prefix.rstrip('/')} do not match this server's model: "
                         f"{len(have)} arrays saved, {len(keys)} expected")
    return jax.tree_util.tree_unflatten(treedef, [arrays[k] for k in keys])


class Store:
    """Saved weights and sampler sessions under `root`."""

    def __init__(self, root: str | os.PathLike):
        self.root = Path(root)
        self.root.mkdir(parents=True, exist_ok=True)

    def _file(self, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        folder = self.root / "weights" / model_id / kind
        return folder / name if kind == EXTERNAL else folder / f"{name}.npz"

    def _info_file(self, path: str) -> Path:
        model_id, kind, name = parse_path(path)
        return self.root / "weights" / model_id / kind / f"{name}.json"

    def external_dir(self, path: str) -> Path:
        """The directory of an external-weights checkpoint (`save_weights_external`)."""
        if parse_path(path)[1] != EXTERNAL:
            raise BadPath(f"{path} is not an external weights path (tinker://<model_id>/"
                          f"{EXTERNAL}/<name>)")
        return self._file(path)

    def write_info(self, path: str, info: dict) -> None:
        atomic_write(self._info_file(path), json.dumps(info).encode())

    def info(self, path: str) -> dict | None:
        """The checkpoint's record (`write_info`), None if nothing is saved at `path`; a save
        without one (an earlier server's) gets its file's time."""
        if not self.has(path):
            return None
        file = self._info_file(path)
        if file.exists():
            return json.loads(file.read_text())
        return {"time": self._file(path).stat().st_mtime}

    def paths(self, model_id: str) -> list[str]:
        """The tinker paths saved under `model_id` (every kind)."""
        out = []
        for kind in KINDS:
            folder = self.root / "weights" / check_model_id(model_id) / kind
            if not folder.is_dir():
                continue
            for f in sorted(folder.iterdir()):
                if f.name.startswith("."):
                    continue
                if (f.is_dir() and kind == EXTERNAL) or (f.suffix == ".npz" and kind != EXTERNAL):
                    out.append(f"tinker://{model_id}/{kind}/{f.stem if f.is_file() else f.name}")
        return out

    def model_ids(self) -> list[str]:
        """Every training client with an owner record or saved weights."""
        ids = {f.stem for f in (self.root / "owners").glob("*.json")}
        ids |= {d.name for d in (self.root / "weights").glob("*") if d.is_dir()}
        return sorted(ids)

    def size(self, path: str) -> int:
        file = self._file(path)
        if file.is_dir():
            return sum(f.stat().st_size for f in file.rglob("*") if f.is_file())
        return file.stat().st_size if file.exists() else 0

    def delete(self, path: str) -> int:
        """Remove the checkpoint at `path` and its record; the bytes freed (0: none there)."""
        file, freed = self._file(path), self.size(path)
        if file.is_dir():
            shutil.rmtree(file)
        else:
            file.unlink(missing_ok=True)
        self._info_file(path).unlink(missing_ok=True)
        return freed

    def link(self, src: str, dst: str) -> None:
        """Make `dst` hold `src`'s files as hard links (no bytes copied; deleting one leaves the
        other), falling back to a copy where links are not possible."""
        a, b = self._file(src), self._file(dst)
        b.parent.mkdir(parents=True, exist_ok=True)

        def link(x, y):
            try:
                os.link(x, y)
            except OSError:
                shutil.copy2(x, y)

        if a.is_dir():
            shutil.copytree(a, b, copy_function=link)
        else:
            link(a, b)

    def save_weights(self, path: str, meta: dict, trees: dict) -> None:
        """`trees`: {"adapters": ..., optionally "mu", "nu"} pytrees of arrays."""
        arrays = {"meta": np.frombuffer(json.dumps(meta).encode(), np.uint8)}
        for prefix, tree in trees.items():
            arrays.update(_flat(prefix + "/", tree))
        buf = io.BytesIO()
        np.savez(buf, **arrays)
        atomic_write(self._file(path), buf.getvalue())

    def has(self, path: str) -> bool:
        """Whether weights are saved at `path`."""
        return self._file(path).exists()

    def load_weights(self, path: str, like: dict) -> tuple[dict, dict] | None:
        """(meta, trees shaped as `like(meta)`), or None if nothing is saved at `path`.
        `like(meta)` gives the expected pytree per prefix present in the file."""
        file = self._file(path)
        if parse_path(path)[1] == EXTERNAL or not file.exists():
            return None
        try:
            with np.load(file) as z:
                arrays = {k: z[k] for k in z.files}
        except FileNotFoundError:  # deleted since (a checkpoint deleted or expired)
            return None
        meta = json.loads(arrays.pop("meta").tobytes())
        prefixes = {k.split("/", 1)[0] for k in arrays}
        shapes = like(meta)
        return meta, {p: _unflat(p + "/", arrays, shapes[p]) for p in sorted(prefixes)}

    def save_sampler(self, session_id: str, path: str | None, owner: str | None = None) -> None:
        check_name(session_id, "sampling session id")
        atomic_write(self.root / "samplers" / f"{session_id}.json",
                     json.dumps({"model_path": path, "owner": owner}).encode())

    def sampler(self, session_id: str) -> dict | None:
        """{"model_path": weights path or None for the base model, "owner": ...}, or None if
        the session is unknown."""
        try:
            check_name(session_id, "sampling session id")
        except BadPath:
            return None
        file = self.root / "samplers" / f"{session_id}.json"
        if not file.exists():
            return None
        return {"owner": None, **json.loads(file.read_text())}

    def write_run(self, model_id: str, info: dict) -> None:
        """A training run's record (`runs/<model_id>.json`: its `user_metadata`)."""
        atomic_write(self.root / "runs" / f"{check_model_id(model_id)}.json",
                     json.dumps(info).encode())

    def run_info(self, model_id: str) -> dict:
        try:
            file = self.root / "runs" / f"{check_model_id(model_id)}.json"
        except BadPath:
            return {}
        return json.loads(file.read_text()) if file.exists() else {}

    def save_owner(self, model_id: str, owner: str | None) -> None:
        check_model_id(model_id)
        atomic_write(self.root / "owners" / f"{model_id}.json",
                     json.dumps({"owner": owner}).encode())

    def owner(self, model_id: str) -> tuple[bool, str | None]:
        """(known, owner) of a training client made by this or an earlier run."""
        try:
            check_model_id(model_id)
        except BadPath:
            return False, None
        file = self.root / "owners" / f"{model_id}.json"
        if not file.exists():
            return False, None
        return True, json.loads(file.read_text())["owner"]
