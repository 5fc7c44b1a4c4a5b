"""The RestClient's routes (tinker 0.38.0): training runs, checkpoints (list, get by path,
delete, TTL, publish), external weights (`save_weights_external`, signed download URLs served
by this server), `copy_weights`, `weights_info`, and a clear refusal for every other RestClient
route. `Rest(service).routes()` is registered by `server.py`; the records behind the
checkpoint routes are `checkpoints.py`'s.

A training run is a training client's model id (live, or known from the state directory). Every
run and checkpoint belongs to its client's owner: another key's answers as an unknown one does
(HTTP 404 naming what was not found), except a published checkpoint, which every key may load
or sample from (`Service._snapshot`). Downloads of external weights carry a signature instead
of a key (`urllib` fetches them as the cookbook does): it names the file and an expiry
(`URL_TTL_S`) and is valid only for this server process.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime
import hashlib
import hmac
import os
import time
import uuid

from aiohttp import web

from jaxrl.service.backend import NotFound, UserError
from jaxrl.service.checkpoints import SWEEP_S, save_options
from jaxrl.service.limits import json_object
from jaxrl.service.store import EXTERNAL, BadPath, check_name, parse_path

V1 = "/api/v1"
DOWNLOADS = f"{V1}/external_files/"  # signed: served without an API key
URL_TTL_S = 3600  # how long a signed download URL stays valid
TYPES = {"weights": "training", "sampler_weights": "sampler", EXTERNAL: "external"}

# RestClient calls this server refuses: route -> (SDK method, why)
REFUSED = {
    f"{V1}/sessions": ("list_sessions", "sessions are not listed by this server"),
    f"{V1}/sessions/search": ("search_sessions", "sessions are not searchable here"),
    f"{V1}/sessions/{{sid}}": ("get_session", "sessions are not listed by this server"),
    f"{V1}/sessions/{{sid}}/project": ("assign_session_project",
                                       "this server has no projects"),
    f"{V1}/sessions/{{sid}}/trace_export": ("export_session_trace",
                                            "this server records no session traces"),
    f"{V1}/audit": ("get_audit_log", "this server keeps no audit log (the request log lines "
                                     "of logger jaxrl.service are its record)"),
    f"{V1}/billing/usage/events": ("get_billing_usage", "this server bills nothing"),
    f"{V1}/billing/usage/checkpoints/current": (
        "get_current_checkpoint_storage_usage", "this server bills nothing; list_checkpoints "
        "gives each checkpoint's size_bytes"),
}


def _iso(t: float | None) -> str | None:
    return None if t is None else datetime.datetime.fromtimestamp(t, datetime.UTC).isoformat()


def _scope(request: web.Request) -> str:
    """`access_scope`: "owned" (the caller's runs) or "accessible" (also those holding a
    published checkpoint)."""
    scope = request.query.get("access_scope", "owned")
    if scope not in ("owned", "accessible"):
        raise UserError(f"access_scope must be 'owned' or 'accessible', got {scope!r}")
    return scope


def _int_param(request: web.Request, name: str, default: int) -> int:
    raw = request.query.get(name, str(default))
    try:
        value = int(raw)
    except ValueError:
        value = -1
    if value < 0:
        raise UserError(f"{name} must be an integer >= 0, got {raw!r}")
    return value


class Rest:
    """The RestClient's routes over a `Service`."""

    def __init__(self, service):
        self.service, self.backend = service, service.backend
        self.checkpoints = service.backend.checkpoints
        self._secret = os.urandom(32)  # signs download URLs; new per server process
        self._copies: dict[str, str] = {}  # X-Idempotency-Key -> the copy it made

    def routes(self) -> list:
        ckpt = f"{V1}/training_runs/{{rid}}/checkpoints/{{kind}}/{{name}}"
        return [
            web.get(f"{V1}/training_runs", self.list_runs),
            web.get(f"{V1}/training_runs/{{rid}}", self.get_run),
            web.get(f"{V1}/training_runs/{{rid}}/checkpoints", self.list_checkpoints),
            web.get(f"{V1}/checkpoints", self.list_user_checkpoints),
            web.delete(ckpt, self.delete),
            web.put(f"{ckpt}/ttl", self.set_ttl),
            web.post(f"{ckpt}/publish", functools_partial(self.publish, True)),
            web.delete(f"{ckpt}/publish", functools_partial(self.publish, False)),
            web.get(f"{ckpt}/external_weights_urls", self.external_urls),
            web.get(f"{DOWNLOADS}{{rid}}/{{name}}/{{file}}", self.download),
            web.post(f"{V1}/weights_info", self.weights_info),
            web.post(f"{V1}/save_weights_external", self.save_external),
            web.post(f"{V1}/copy_weights", self.copy_weights),
            *[web.route("*", route, functools_partial(_refuse, *why))
              for route, why in REFUSED.items()],
        ]

    async def sweeper(self, app):
        """aiohttp cleanup context: delete expired checkpoints every `SWEEP_S` seconds."""

        async def loop():
            while True:
                await asyncio.to_thread(self.checkpoints.sweep)
                await asyncio.sleep(SWEEP_S)

        task = asyncio.create_task(loop())
        yield
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    # --------------------------------------------------------------------- runs and paths

    def _runs(self, request, scope: str = "owned") -> list[str]:
        ids = set(self.backend.models) | set(self.service.model_owner)
        ids |= set(self.checkpoints.model_ids())
        return sorted(r for r in ids if self._mine(request, r, scope))

    def _mine(self, request, run_id: str, scope: str = "owned") -> bool:
        """Whether the caller owns the run, or (`scope` "accessible") it holds a published
        checkpoint."""
        known, owner = self.service._owner_of_model(run_id)
        paths = self.checkpoints.paths(run_id)
        known = known or run_id in self.backend.models or bool(paths)
        return known and (self.service._allowed(request, owner) or (
            scope == "accessible" and any(self.checkpoints.is_public(p) for p in paths)))

    def _run_id(self, request, run_id: str, scope: str = "owned") -> str:
        if not self._mine(request, run_id, scope):
            mine = self._runs(request)
            raise NotFound(f"unknown training run {run_id!r}; yours here: "
                           f"{mine[:20] or 'none'}" + (" ..." if len(mine) > 20 else ""))
        return run_id

    def _path(self, request, rid: str, kind: str, name: str) -> str:
        """The caller's live checkpoint `tinker://<rid>/<kind>/<name>`, else a 404 naming
        it and the run's checkpoints."""
        run_id = self._run_id(request, rid)
        path = f"tinker://{run_id}/{kind}/{name}"
        try:
            parse_path(path)
        except BadPath as e:
            raise UserError(str(e)) from e
        if self.checkpoints.info(path) is None:
            have = [p.split("/", 3)[3] for p in self.checkpoints.paths(run_id)]
            raise NotFound(f"no checkpoint {kind}/{name} in training run {run_id!r} (deleted, "
                           f"expired or never saved); it has {have or 'none'}")
        return path

    def _checkpoint(self, path: str) -> dict | None:
        info = self.checkpoints.info(path)
        if info is None:
            return None
        kind = parse_path(path)[1]
        return {"checkpoint_id": path.split("/", 3)[3], "checkpoint_type": TYPES[kind],
                "time": _iso(info["time"]), "tinker_path": path,
                "size_bytes": self.checkpoints.size(path), "public": bool(info.get("public")),
                "user_metadata": info.get("user_metadata"),
                "expires_at": _iso(info.get("expires_at"))}

    def _run(self, run_id: str) -> dict:
        ckpts = [c for p in self.checkpoints.paths(run_id) if (c := self._checkpoint(p))]
        last = lambda t: next((c for c in reversed(ckpts) if c["checkpoint_type"] == t), None)
        live = self.backend.models.get(run_id)
        if live is not None:
            lc = live.lora
        else:  # from its latest save of weights
            saved = [c["tinker_path"] for c in ckpts if c["checkpoint_type"] != "external"]
            lc = self.backend.snapshot(saved[-1]).lora if saved else None
        times = [c["time"] for c in ckpts]
        owner = self.service._owner_of_model(run_id)[1]
        return {"training_run_id": run_id, "base_model": self.backend.name,
                "model_owner": owner or "local", "is_lora": lc is not None or (
                    live is None and not self.service.full_params),
                "lora_rank": None if lc is None else lc.rank, "corrupted": False,
                "last_request_time": max(times) if times else _iso(time.time()),
                "last_checkpoint": last("training"), "last_sampler_checkpoint": last("sampler"),
                "user_metadata": self.checkpoints.run_info(run_id).get("user_metadata")}

    # ----------------------------------------------------------------------------- routes

    async def list_runs(self, request):
        """The caller's runs; with `project_id`, those holding a copy made into that project
        (`copy_weights`' destination_project_id: the only projects here)."""
        runs = self._runs(request, _scope(request))
        project = request.query.get("project_id")
        if project is not None:
            runs = [r for r in runs if any(
                (self.checkpoints.info(p) or {}).get("project_id") == project
                for p in self.checkpoints.paths(r))]
        limit, offset = _int_param(request, "limit", 20), _int_param(request, "offset", 0)
        page = [self._run(r) for r in runs[offset:offset + limit]]
        return web.json_response({"training_runs": page, "cursor": {
            "offset": offset, "limit": limit, "total_count": len(runs)}})

    async def get_run(self, request):
        run_id = self._run_id(request, request.match_info["rid"], _scope(request))
        return web.json_response(self._run(run_id))

    async def list_checkpoints(self, request):
        run_id = self._run_id(request, request.match_info["rid"])
        ckpts = [c for p in self.checkpoints.paths(run_id) if (c := self._checkpoint(p))]
        return web.json_response({"checkpoints": ckpts, "cursor": None})

    async def list_user_checkpoints(self, request):
        """Every checkpoint of the caller's runs, newest first."""
        ckpts = [c for r in self._runs(request) for p in self.checkpoints.paths(r)
                 if (c := self._checkpoint(p))]
        ckpts.sort(key=lambda c: c["time"], reverse=True)
        limit, offset = _int_param(request, "limit", 100), _int_param(request, "offset", 0)
        return web.json_response({"checkpoints": ckpts[offset:offset + limit], "cursor": {
            "offset": offset, "limit": limit, "total_count": len(ckpts)}})

    async def delete(self, request):
        """Deletes the checkpoint's files (disk is freed at once) and its record."""
        path = self._path(request, **request.match_info)
        self.backend.delete(path)
        return web.json_response(None)

    async def set_ttl(self, request):
        path = self._path(request, **request.match_info)
        body = await _body(request)
        ttl = save_options({"ttl_seconds": body.get("ttl_seconds")},
                           "set_checkpoint_ttl")["ttl_seconds"]
        self.checkpoints.set_ttl(path, ttl)
        return web.json_response(None)

    async def publish(self, public: bool, request):
        """A published checkpoint can be loaded and sampled by every key of this server."""
        path = self._path(request, **request.match_info)
        self.checkpoints.update(path, public=public)
        return web.json_response(None)

    async def weights_info(self, request):
        body = await _body(request)
        snap = self.service._snapshot(request, body["tinker_path"])
        lc = snap.lora
        targets = () if lc is None else lc.targets
        return web.json_response({
            "base_model": self.backend.name, "is_lora": lc is not None,
            "lora_rank": None if lc is None else lc.rank, "train_unembed": False,
            "train_mlp": lc is None or "up" in targets, "train_attn": lc is None or "q" in targets})

    # ------------------------------------------------------------------- external weights

    async def save_external(self, request):
        """`TrainingClient.save_weights_external(name)`: the client's weights as a PEFT adapter
        directory (`adapter_config.json` + `adapter_model.safetensors`; a full-parameter client:
        a Hugging Face model directory) under the state directory."""
        body = await _body(request)
        model_id = body["model_id"]
        self.service._model(request, model_id)
        if self.backend.store is None:
            raise UserError("save_weights_external: this server has no state directory to "
                            "write files to (start it with --state-dir)")
        if body.get("age_encryption_recipients"):
            raise UserError("save_weights_external: age_encryption_recipients is not supported "
                            "(files are served unencrypted, from this host)")
        name = check_name(body.get("path") or f"external-{uuid.uuid4().hex[:8]}",
                          "save_weights_external name")
        opts = save_options(body, "save_weights_external")
        path = f"tinker://{model_id}/{EXTERNAL}/{name}"

        def run():
            size = self._export(model_id, path, opts)
            return {"type": "save_weights_external", "path": path, "size_bytes": size}

        return self.service.submit(request, run, model_id=model_id)

    def _export(self, model_id: str, path: str, opts: dict) -> int:
        from flax import nnx

        from jaxrl.models.hf import save_pretrained
        from jaxrl.models.peft_io import save_adapter

        m = self.backend.get(model_id)
        out = self.backend.store.external_dir(path)
        if out.exists():
            self.backend.delete(path)  # a name saved again replaces the old files
        tmp = out.with_name(f".{out.name}.{uuid.uuid4().hex[:8]}.tmp")
        if m.lora is None:
            save_pretrained(nnx.merge(m.graphdef, m.adapters), self.backend.cfg, tmp)
        else:
            cfg = dataclasses.replace(self.backend.cfg, lora=m.lora)
            save_adapter(m.adapters, tmp, cfg, base_model_name_or_path=self.backend.name)
        os.replace(tmp, out)
        self.checkpoints.record(path, **opts)
        return self.checkpoints.size(path)

    async def external_urls(self, request):
        path = self._path(request, **request.match_info)
        run_id, kind, name = parse_path(path)
        if kind != EXTERNAL:
            raise UserError(f"{path} is not external weights (save_weights_external makes them)")
        folder = self.backend.store.external_dir(path)
        expires = int(time.time()) + URL_TTL_S
        base = f"{request.scheme}://{request.host}{DOWNLOADS}{run_id}/{name}"
        urls = {f.name: f"{base}/{f.name}?expires={expires}&signature="
                        f"{self._sign(run_id, name, f.name, expires)}"
                for f in sorted(folder.iterdir()) if f.is_file()}
        return web.json_response({"urls": urls, "expires": _iso(expires)})

    def _sign(self, run_id: str, name: str, file: str, expires: int) -> str:
        msg = f"{run_id}/{name}/{file}/{expires}".encode()
        return hmac.new(self._secret, msg, hashlib.sha256).hexdigest()

    async def download(self, request):
        """A file of external weights, by a URL from `external_urls` (its signature, no key)."""
        run_id, name, file = (request.match_info[k] for k in ("rid", "name", "file"))
        try:
            expires = int(request.query.get("expires", ""))
        except ValueError:
            expires = 0
        sig = request.query.get("signature", "")
        if not hmac.compare_digest(sig, self._sign(run_id, name, file, expires)):
            raise web.HTTPForbidden(text="bad download signature: ask get_external_weights_urls "
                                         "for new URLs")
        if expires < time.time():
            raise web.HTTPForbidden(text="this download URL expired: ask "
                                         "get_external_weights_urls for new ones")
        path = f"tinker://{run_id}/{EXTERNAL}/{name}"
        target = self.backend.store.external_dir(path) / file
        if self.checkpoints.info(path) is None or not target.is_file():
            raise NotFound(f"no file {file!r} in {path} (deleted or expired)")
        return web.FileResponse(target)

    # ----------------------------------------------------------------------------- copies

    async def copy_weights(self, request):
        """A copy of a checkpoint as a new training run's (`copy-<id>`), owned by the caller,
        which cannot be trained on (as Tinker's); its files are hard links, so no bytes are
        duplicated and deleting either leaves the other."""
        body = await _body(request)
        if body.get("weights_access_token") is not None:
            raise UserError("copy_weights: weights_access_token is not supported (checkpoints "
                            "are shared between keys by publish_checkpoint_from_tinker_path)")
        idem = request.headers.get("X-Idempotency-Key")
        if idem in self._copies:
            return web.json_response({"tinker_path": self._copies[idem]})
        src = body["source_path"]
        try:
            src_run, kind, name = parse_path(src)
        except BadPath as e:
            raise UserError(f"copy_weights: {e}") from e
        if kind == EXTERNAL:  # files only: no weights to load
            snap = None
            if not self.checkpoints.is_public(src):
                self._path(request, src_run, kind, name)
        else:
            snap = self.service._snapshot(request, src)
        opts = save_options(body, "copy_weights")
        run_id = f"copy-{uuid.uuid4().hex[:12]}"
        dst = f"tinker://{run_id}/{kind}/{name}"
        owner = self.service._owner(request)
        if self.backend.store is not None:
            self.backend.store.save_owner(run_id, owner)
            self.backend.store.link(src, dst)
        self.service.model_owner[run_id] = owner
        if snap is not None:
            self.backend.snapshots[dst] = snap
        self.checkpoints.record(dst, **opts, project_id=body.get("destination_project_id"))
        if idem is not None:
            self._copies[idem] = dst
        return web.json_response({"tinker_path": dst})


def functools_partial(fn, *args):
    """An aiohttp handler with leading arguments bound (aiohttp wants a coroutine function)."""

    async def handler(request):
        return await fn(*args, request)

    return handler


async def _refuse(method: str, why: str, request):
    raise UserError(f"RestClient.{method} is not supported by this server: {why}")


async def _body(request: web.Request) -> dict:
    """The request's JSON body, which must be an object."""
    return json_object(await request.read(), request.path.rsplit("/", 1)[-1])
