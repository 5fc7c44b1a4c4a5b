"""The service's checkpoint records: when each save was made, when it expires, whether it is
published, its user metadata; listing, expiry and deletion that frees disk.

A checkpoint is a weights path, `tinker://<model_id>/<kind>/<name>` (kind `weights`: a
`save_state`, `sampler_weights`: a `save_weights_for_sampler`, `external_weights`: a
`save_weights_external` directory). Its record is `{"time", "expires_at", "public",
"user_metadata"}` (times in seconds since the epoch; `expires_at` None: never), written beside
the weights (`store.py`) when the server has a state directory, else kept in memory with the
weights. A save's `ttl_seconds` sets `expires_at`; an expired checkpoint is deleted, files and
record, when it is next looked up or listed and by the server's sweep (`Checkpoints.sweep`,
run every `SWEEP_S` seconds by `rest.py`).
"""

from __future__ import annotations

import threading
import time

from jaxrl.service.store import BadPath, Store, parse_path

SWEEP_S = 60.0  # how often expired checkpoints are deleted (besides when they are looked up)


def save_options(body: dict, what: str) -> dict:
    """A save request's `ttl_seconds` and `user_metadata`, checked (`what` names the call)."""
    ttl, meta = body.get("ttl_seconds"), body.get("user_metadata")
    if ttl is not None and (isinstance(ttl, bool) or not isinstance(ttl, int) or ttl < 1):
        raise ValueError(f"{what}: ttl_seconds must be an integer >= 1 (or None: never "
                         f"expires), got {ttl!r}")
    if meta is not None and not (isinstance(meta, dict) and all(
            isinstance(k, str) and isinstance(v, str) for k, v in meta.items())):
        raise ValueError(f"{what}: user_metadata must map strings to strings, got {meta!r}")
    return {"ttl_seconds": ttl, "user_metadata": meta}


class Checkpoints:
    """The records of one server's checkpoints (on disk under `store`, else in memory)."""

    def __init__(self, store: Store | None):
        self.store = store
        self.records: dict[str, dict] = {}  # path -> record; the store's are read from disk
        self.runs: dict[str, dict] = {}  # model id -> its record, without a store
        self._lock = threading.Lock()  # the worker saves while the HTTP thread lists

    def record(self, path: str, ttl_seconds: int | None = None,
               user_metadata: dict | None = None, **extra) -> dict:
        """A new record for a save just written at `path`."""
        now = time.time()
        info = {"time": now, "expires_at": None if ttl_seconds is None else now + ttl_seconds,
                "public": False, "user_metadata": user_metadata, **extra}
        self._write(path, info)
        return info

    def _write(self, path: str, info: dict) -> None:
        with self._lock:
            if self.store is not None:
                self.store.write_info(path, info)
            else:
                self.records[path] = info

    def set_run_info(self, model_id: str, **info) -> None:
        """A training run's record (its `user_metadata` from `create_model`)."""
        if self.store is not None:
            self.store.write_run(model_id, info)
        else:
            self.runs[model_id] = info

    def run_info(self, model_id: str) -> dict:
        return self.store.run_info(model_id) if self.store is not None else self.runs.get(
            model_id, {})

    def info(self, path: str) -> dict | None:
        """The record of the checkpoint at `path`, None if there is none (or it expired: then
        it is deleted)."""
        try:
            parse_path(path)
        except BadPath:
            return None
        with self._lock:
            info = self.store.info(path) if self.store is not None else self.records.get(path)
        if info is not None and _expired(info):
            self.delete(path)
            return None
        return info

    def expired(self, path: str) -> bool:
        """Whether `path` has a record whose TTL ran out (deleting it, as `info` does)."""
        with self._lock:
            info = self.store.info(path) if self.store is not None else self.records.get(path)
        if info is None or not _expired(info):
            return False
        self.delete(path)
        return True

    def update(self, path: str, **fields) -> dict:
        info = self.info(path)
        if info is None:
            raise KeyError(path)
        info = {**info, **fields}
        self._write(path, info)
        return info

    def set_ttl(self, path: str, ttl_seconds: int | None) -> dict:
        return self.update(path, expires_at=None if ttl_seconds is None
                           else time.time() + ttl_seconds)

    def is_public(self, path: str) -> bool:
        info = self.info(path)
        return info is not None and bool(info.get("public"))

    def paths(self, model_id: str) -> list[str]:
        """The live checkpoints of `model_id`, oldest first."""
        with self._lock:
            if self.store is not None:
                try:
                    found = self.store.paths(model_id)
                except BadPath:
                    return []
            else:
                found = [p for p in self.records if parse_path(p)[0] == model_id]
        live = [(info["time"], p) for p in found if (info := self.info(p)) is not None]
        return [p for _, p in sorted(live)]

    def model_ids(self) -> list[str]:
        """Every model id with a checkpoint record or, on disk, an owner record."""
        if self.store is not None:
            return self.store.model_ids()
        return sorted({parse_path(p)[0] for p in self.records})

    def size(self, path: str) -> int | None:
        return None if self.store is None else self.store.size(path)

    def delete(self, path: str) -> int:
        """Delete the checkpoint's files and record; the bytes freed on disk."""
        with self._lock:
            self.records.pop(path, None)
            return 0 if self.store is None else self.store.delete(path)

    def sweep(self) -> list[str]:
        """Delete every expired checkpoint; their paths."""
        gone = []
        for model_id in self.model_ids():
            with self._lock:
                found = (self.store.paths(model_id) if self.store is not None
                         else [p for p in self.records if parse_path(p)[0] == model_id])
            gone += [p for p in found if self.expired(p)]
        return gone


def _expired(info: dict) -> bool:
    return info.get("expires_at") is not None and info["expires_at"] <= time.time()
