"""The HTTP side of the Tinker-compatible service (aiohttp): routes, futures, errors, auth.

The SDK's model (tinker 0.38): every training and sampling call is a POST that returns a
future id at once (`{"request_id": ...}`); the client then polls `/api/v1/retrieve_future`,
which this server holds open up to `POLL_S` seconds and answers with the result, `{"type":
"try_again"}` (still running: the client polls again) or `{"error", "category"}` (the SDK raises
`RequestFailedError`). Forward/backward bodies and results, and sample results, are protobuf
(`wire.py`); the rest is JSON. All model work runs on one worker thread (`worker.py`), taking
turns fairly between API keys; one client's `forward_backward` -> `optim_step` -> `save`
sequence applies in the order sent. A sampling request can be cancelled (`cancel_future`).

A request that is wrong on its face (unknown model or weights, unknown loss, wrong shapes, over
a limit of `limits.py`, a body that is not a JSON object) is refused before it is queued with
HTTP 400/404 and `{"error": ...}`: the SDK
raises `tinker.BadRequestError` / `tinker.NotFoundError` with that message, and the server goes
on serving.

Credentials: with keys set (`--api-key`, `--api-keys FILE`) every request must carry one
(`X-API-Key`, as the SDK sends it; else HTTP 401, the SDK's `AuthenticationError`). Each key is
its own owner, and everything a request creates (a training client and so every weights path
under `tinker://<model_id>/`, a sampling session, a future) belongs to its key's owner. Another
owner's model, path, sampler or future answers exactly as an unknown one does (HTTP 404, the
SDK's `NotFoundError`), so one key learns nothing of another's. Owners are recorded on disk
beside the saves (`store.py`). Without keys (localhost) there is one owner.
"""

from __future__ import annotations

import asyncio
import collections
import functools
import hashlib
import itertools
import logging
import re
import time
import traceback
import uuid

from aiohttp import web

from jaxrl.service.backend import Backend, NotFound, UserError, lora_config
from jaxrl.service.checkpoints import save_options
from jaxrl.service.limits import Limits, SampleRequest, json_object
from jaxrl.service.logs import log_outcome, log_request
from jaxrl.service.prompt_scores import requested_k, requested_targets, with_scores
from jaxrl.service.rest import DOWNLOADS, Rest
from jaxrl.service.running import Running, serve  # noqa: F401 - the server's entry points
from jaxrl.service.stability import StabilityRecords
from jaxrl.service.store import BadPath, check_model_id, check_name, parse_path
from jaxrl.service.wire import (
    WireError,
    encode_forward_backward_output,
    encode_sample_response,
    parse_forward_backward,
)
from jaxrl.service.worker import Cancelled, Worker

log = logging.getLogger("jaxrl.service")
POLL_S = 30.0  # how long retrieve_future waits before answering try_again
KEEP_FUTURES = 4096  # finished results kept for clients that re-poll
PROTO = "application/x-protobuf"
_REQUEST_ID = re.compile(r"req-[0-9a-f]{8}-[0-9]+")


def owner_of(key: str) -> str:
    """The owner id of an API key: a hash, so the key itself is never written to disk."""
    return "owner-" + hashlib.sha256(key.encode()).hexdigest()[:16]


class Service:
    """Routes + futures over a `Backend`; `app()` is the aiohttp application.

    `api_key` / `api_keys`: the accepted keys, each its own owner (none: no check, one owner).
    `full_params`: every training client trains all base parameters (one owner only).
    `limits`: what one request may ask (`jaxrl.service.limits`)."""

    def __init__(self, backend: Backend, api_key: str | None = None, *, api_keys=(),
                 full_params: bool = False, limits: Limits | None = None):
        self.backend, self.limits = backend, limits or Limits()
        self.keys = {k: owner_of(k) for k in ([api_key] if api_key else []) + list(api_keys)}
        if full_params and len(self.keys) > 1:
            raise ValueError(f"full-parameter mode serves a single owner; got {len(self.keys)} "
                             "API keys")
        self.full_params = full_params
        self.worker = Worker()  # batches queued forward_backward / sample requests of any clients
        # request id -> (future, owner, cancellable)
        self.futures: collections.OrderedDict[str, tuple] = collections.OrderedDict()
        self.sessions: dict[str, str | None] = {}  # session id -> owner
        self.samplers: dict[str, tuple] = {}  # session -> (weights path or None: base, owner)
        self.model_owner: dict[str, str | None] = {}
        self.inflight: dict[str, str] = {}  # model id -> path of its latest inflight save
        self.inflight_sessions: dict[str, str] = {}  # inflight sampling session -> model id
        self.stability = StabilityRecords()  # record_stability_info's records (stable_reinforce)
        self._ids = itertools.count()

    # ----------------------------------------------------------------------------- plumbing

    def submit(self, request, fn, *args, model_id: str | None = None, key=None,
               cancellable: bool = False, **extra) -> web.Response:
        """Queue `fn(*args)`; with a batch `key`, `fn([arg, ...])` of all queued jobs of that key
        (`Worker.submit_many`). `model_id` is the job's lane: one client's jobs keep their order.
        The job's tenant, served fairly against the others, is the request's key."""
        request_id = f"req-{self.backend.epoch}-{next(self._ids)}"
        key_sent = request.headers.get("X-API-Key")
        tenant = None if key_sent is None else owner_of(key_sent)
        job = (self.worker.submit(fn, *args, lane=model_id, tenant=tenant) if key is None
               else self.worker.submit_many(fn, args[0], key, lane=model_id, tenant=tenant))
        self.futures[request_id] = (job, self._owner(request), cancellable)
        job.add_done_callback(functools.partial(log_outcome, request_id,
                                                f"{request.method} {request.path}", tenant))
        while len(self.futures) > KEEP_FUTURES:
            self.futures.popitem(last=False)
        return web.json_response({"request_id": request_id, "model_id": model_id, **extra})

    def _owner(self, request) -> str | None:
        """The owner of the request's key (None without keys; the middleware checked it)."""
        return self.keys.get(request.headers.get("X-API-Key"))

    def _allowed(self, request, owner: str | None) -> bool:
        return not self.keys or owner == self._owner(request)

    def _owner_of_model(self, model_id: str) -> tuple[bool, str | None]:
        """(known, owner) of a training client of this run or, from the store, an earlier one."""
        if model_id in self.model_owner:
            return True, self.model_owner[model_id]
        if self.backend.store is not None:
            return self.backend.store.owner(model_id)
        return False, None

    def _model(self, request, model_id):
        """The caller's live training client; another owner's answers as an unknown one."""
        if model_id in self.backend.models and self._allowed(
                request, self.model_owner.get(model_id)):
            return self.backend.models[model_id]
        mine = sorted(m for m in self.backend.models
                      if self._allowed(request, self.model_owner.get(m)))
        raise NotFound(f"unknown model_id {model_id!r}; this server holds {mine or 'no models'}"
                       " for you (training clients do not survive a server restart: create "
                       "one and load_state a saved path)")

    def _snapshot(self, request, path: str):
        """Saved weights by path, if the caller owns the training client that saved them."""
        if self.keys:
            try:
                known, owner = self._owner_of_model(parse_path(path)[0])
            except BadPath:
                known, owner = False, None
            mine = known and owner == self._owner(request)
            if not mine and not self.backend.checkpoints.is_public(path):
                raise NotFound(f"unknown weights path {path!r}")
        return self.backend.snapshot(path)

    @web.middleware
    async def middleware(self, request: web.Request, handler):
        """Errors as JSON `{"error"}` with their status; each request is one log line
        (`jaxrl.service.logs`)."""
        start = time.perf_counter()
        response = await self._answer(request, handler)
        log_request(request, response, _key_id(request), time.perf_counter() - start)
        return response

    async def _answer(self, request: web.Request, handler):
        if (self.keys and request.headers.get("X-API-Key") not in self.keys
                and not request.path.startswith(DOWNLOADS)):  # (signed URLs: `rest.py`)
            return web.json_response({"error": "missing or unknown X-API-Key"}, status=401)
        try:
            # a body over the limit is refused from its Content-Length, before it is read
            self.limits.check_body_size(request.content_length)
            return await handler(request)
        except NotFound as e:
            return web.json_response({"error": str(e)}, status=404)
        except web.HTTPRequestEntityTooLarge:  # no Content-Length: found while reading
            return web.json_response({"error": self.limits.too_large("the request body")},
                                     status=400)
        except (UserError, WireError, KeyError, TypeError, ValueError) as e:
            msg = f"missing field {e}" if isinstance(e, KeyError) else str(e)
            return web.json_response({"error": msg}, status=400)
        except web.HTTPException as e:  # aiohttp's own (no such route, wrong method)
            if e.status < 400:
                raise
            what = (f"this server has no route {request.method} {request.path}"
                    if e.status in (404, 405) else e.text)
            return web.json_response({"error": f"{e.reason}: {what}"}, status=e.status)
        except Exception as e:  # noqa: BLE001 - one line to the client, the traceback logged
            log.error("%s %s failed:\n%s", request.method, request.path, traceback.format_exc())
            return web.json_response({"error": f"internal error: {type(e).__name__}: {e}"},
                                     status=500)

    async def retrieve_future(self, request: web.Request) -> web.Response:
        body = await _body(request)
        fut, owner, _ = self.futures.get(body["request_id"], (None, None, False))
        if fut is not None and not self._allowed(request, owner):
            raise NotFound(f"unknown request_id {body['request_id']!r}")
        if fut is None and _REQUEST_ID.fullmatch(str(body["request_id"])):
            # accepted by an earlier run of this server (or long forgotten): 410 makes the SDK
            # raise RetryableException, which a sampling client answers by sending it again
            return web.json_response(
                {"error": f"request {body['request_id']} was lost (the server restarted or "
                          "forgot it); send it again"}, status=410)
        if fut is None:
            raise NotFound(f"unknown request_id {body['request_id']!r}")
        try:
            result = await asyncio.wait_for(asyncio.shield(asyncio.wrap_future(fut)), POLL_S)
        except TimeoutError:
            return web.json_response({"type": "try_again", "request_id": body["request_id"],
                                      "queue_state": "active"})
        except asyncio.CancelledError:
            if not fut.cancelled():
                raise  # this poll was cut (the client went away), not the request
            return web.json_response({"error": f"request {body['request_id']} was cancelled",
                                      "category": "user"})
        except Cancelled as e:
            return web.json_response({"error": f"request {body['request_id']} was cancelled "
                                      f"({e})", "category": "user"})
        except UserError as e:  # (logged when it failed: `log_outcome`)
            return web.json_response({"error": str(e), "category": "user"})
        except Exception as e:  # noqa: BLE001 - reported to the client
            return web.json_response({"error": f"{type(e).__name__}: {e}", "category": "server"})
        if isinstance(result, bytes):
            return web.Response(body=result, content_type=PROTO)
        return web.json_response(result)

    async def cancel_future(self, request: web.Request) -> web.Response:
        """Tinker's `cancel_future` (the SDK sends it for a sampling future it abandons, since
        `client/dynamic_config` says `sample_cancel_enabled`): a queued sampling request is
        dropped, a running one stops before its next decode chunk. Idempotent: a finished or
        already cancelled request is left as it is."""
        body = await _body(request)
        fut, owner, cancellable = self.futures.get(body["request_id"], (None, None, False))
        if fut is None or not self._allowed(request, owner):
            raise NotFound(f"unknown request_id {body['request_id']!r}")
        if not cancellable:
            raise UserError(f"request {body['request_id']} is not a sampling request; only "
                            "sampling requests can be cancelled (as in Tinker)")
        self.worker.cancel(fut)
        return web.json_response(None)

    # ------------------------------------------------------------------------ session, info

    async def capabilities(self, request):
        info = self.backend.info()
        return web.json_response({"supported_models": [
            {**info, "trainable": True, "sampleable": True}]})

    async def client_config(self, request):
        # httpx transport (no pyqwest), uncompressed proto bodies, retrieve_future per request
        return web.json_response({"pjwt_auth_enabled": False, "use_pyqwest_transport": False,
                                  "proto_compress_fwdbwd": False,
                                  "fwdbwd_max_chunk_len": 1024})

    async def create_session(self, request):
        await _body(request)
        sid = f"session-{uuid.uuid4().hex[:12]}"
        self.sessions[sid] = self._owner(request)
        return web.json_response({"type": "create_session", "session_id": sid})

    async def finish_session(self, request):
        """`ServiceClient.close(status)`: the session ends (idempotent; a session from before a
        restart is already gone). Its models stay: other sessions may hold their paths."""
        await _body(request)
        sid = request.match_info["sid"]
        if sid in self.sessions and self._allowed(request, self.sessions[sid]):
            del self.sessions[sid]
        return web.json_response(None)

    async def get_info(self, request):
        body = await _body(request)
        m = self._model(request, body["model_id"])
        return web.json_response({
            "type": "get_info", "model_id": m.model_id, "is_lora": m.lora is not None,
            "lora_rank": None if m.lora is None else m.lora.rank,
            "model_name": self.backend.name,
            "model_data": {"arch": self.backend.cfg.architecture,
                           "model_name": self.backend.name, "tokenizer_id": None}})

    # ----------------------------------------------------------------------------- training

    async def create_model(self, request):
        body = await _body(request)
        self._check_base(body["base_model"])
        lc = body.get("lora_config") or {}
        if not isinstance(lc, dict):
            raise UserError(f"create_model: lora_config must be an object, got {lc!r:.80}")
        if "rank" not in lc and not self.full_params:
            raise UserError("create_model: this server trains LoRA adapters only; pass "
                            "lora_config with a rank (create_lora_training_client)")
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserError(f"optimizer {opt!r} is not supported (adamw only)")
        if self.full_params:  # the LoRA request (rank, targets) trains every base parameter
            create = self.backend.create_full
        else:
            cfg = lora_config(lc["rank"], lc.get("train_attn", True), lc.get("train_mlp", True))
            self.limits.check_rank(cfg.rank)
            create = lambda: self.backend.create(cfg, seed=lc.get("seed"))
        owner, meta = self._owner(request), body.get("user_metadata")
        if meta is not None and not isinstance(meta, dict):
            raise UserError(f"create_model: user_metadata must be an object, got {meta!r:.80}")

        def run():
            model_id = create()
            self.model_owner[model_id] = owner
            if self.backend.store is not None:
                self.backend.store.save_owner(model_id, owner)
            if meta is not None:  # (the training run's, for the RestClient: rest.py)
                self.backend.checkpoints.set_run_info(model_id, user_metadata=meta)
            return {"type": "create_model", "model_id": model_id}

        return self.submit(request, run)

    def _check_base(self, name):
        if name != self.backend.name:
            raise NotFound(f"unknown base model {name!r}; this server serves "
                           f"{self.backend.name!r}")

    async def forward_backward(self, request):
        req = parse_forward_backward(await request.read())
        self._model(request, req.model_id)
        self.stability.attach(req.loss_fn, req.data, self._owner(request))  # stable_reinforce's
        self.backend.check(req)

        def run(reqs):  # this request and the compatible ones queued with it, in one step
            return [encode_forward_backward_output(outputs, metrics)
                    for outputs, metrics in self.backend.forward_backward_many(reqs)]

        return self.submit(request, run, req, model_id=req.model_id,
                           key=self.backend.batch_key(req))

    async def optim_step(self, request):
        body = await _body(request)
        self._model(request, body["model_id"])
        if "adam_params" not in body:
            raise UserError("optim_step: only AdamParams are supported")
        adam = body["adam_params"]
        step = lambda: {"metrics": self.backend.optim_step(body["model_id"], adam)}
        return self.submit(request, step, model_id=body["model_id"])

    async def save_weights(self, request):
        body = await _body(request)
        self._model(request, body["model_id"])
        name, overwrite = body.get("path"), bool(body.get("overwrite", False))
        opts = save_options(body, "save_state")  # ttl_seconds, user_metadata
        if name is not None:
            check_name(name, "save_state name")
            path = f"tinker://{body['model_id']}/weights/{name}"
            if not overwrite and self.backend.saved(path):  # (checked again when it runs)
                raise UserError(f"save_state: {path} exists; pass overwrite=True to replace it")

        def run():
            path = self.backend.save(body["model_id"], "weights", name, True, overwrite, **opts)
            return {"type": "save_weights", "path": path}

        return self.submit(request, run, model_id=body["model_id"])

    async def load_weights(self, request):
        body = await _body(request)
        if body.get("model_id") is None:
            return self._create_from_state(request, body)
        self._model(request, body["model_id"])
        self._snapshot(request, body["path"])

        def run():
            self.backend.load_state(body["model_id"], body["path"], bool(body.get("optimizer")))
            return {"type": "load_weights", "path": body["path"], "model_id": body["model_id"]}

        return self.submit(request, run, model_id=body["model_id"])

    def _create_from_state(self, request, body):
        """`create_training_client_from_state[_with_optimizer]`: a load that is the new client's
        first request. The SDK names the client itself, `<session_id>:train:<model_seq_id>`, and
        next asks `get_info` of that id. The session must be the caller's (one this server does
        not know, e.g. from before a restart, is adopted by the caller)."""
        sid, seq = body.get("session_id"), body.get("model_seq_id")
        if sid is None or seq is None:
            raise UserError("load_weights: name a model_id (load_state), or a session_id and "
                            "model_seq_id (create_training_client_from_state)")
        model_id = check_model_id(f"{check_name(sid, 'session_id')}:train:{int(seq)}")
        if not self._allowed(request, self.sessions.setdefault(sid, self._owner(request))):
            raise NotFound(f"unknown session {sid!r}")
        if model_id in self.backend.models or self._owner_of_model(model_id)[0]:
            raise UserError(f"model_id {model_id!r} already exists")
        if body.get("base_model") is not None:
            self._check_base(body["base_model"])
        opt = (body.get("optimizer_config") or {}).get("type", "adamw")
        if opt != "adamw":
            raise UserError(f"optimizer {opt!r} is not supported (adamw only)")
        snap = self._snapshot(request, body["path"])
        if (snap.lora is None) != self.full_params:
            kind = lambda full: "all parameters" if full else "LoRA adapters"
            raise UserError(f"{body['path']} holds {kind(snap.lora is None)}; this server "
                            f"trains {kind(self.full_params)}")
        owner, with_optimizer = self._owner(request), bool(body.get("optimizer"))

        def run():
            self.backend.create_from_state(body["path"], with_optimizer, model_id)
            self.model_owner[model_id] = owner
            if self.backend.store is not None:
                self.backend.store.save_owner(model_id, owner)
            return {"type": "load_weights", "path": body["path"], "model_id": model_id}

        return self.submit(request, run, model_id=model_id)

    async def save_weights_for_sampler(self, request):
        body = await _body(request)
        self._model(request, body["model_id"])
        name, kind, model_id = body.get("path"), body.get("kind") or "snapshot", body["model_id"]
        if name is not None:
            check_name(name, "save_weights_for_sampler name")
        if kind not in ("snapshot", "inflight"):
            raise UserError(f"save_weights_for_sampler: kind {kind!r} is not one of 'snapshot', "
                            "'inflight'")
        opts = save_options(body, "save_weights_for_sampler")  # ttl_seconds, user_metadata
        if kind == "inflight" and name is not None:
            raise UserError("save_weights_for_sampler: an inflight save is not named (it "
                            "publishes the client's shared sampling weights)")
        owner = self._owner(request)

        def run():
            path = self.backend.save(model_id, "sampler_weights", name, False, **opts)
            if name is not None:
                return {"type": "save_weights_for_sampler", "path": path}
            sid = self._new_sampler(path, owner)
            if kind == "inflight":  # every inflight session of the client samples this now
                self.inflight[model_id] = path
                self.inflight_sessions[sid] = model_id
            return {"type": "save_weights_for_sampler", "sampling_session_id": sid}

        return self.submit(request, run, model_id=body["model_id"])

    # ----------------------------------------------------------------------------- sampling

    def _new_sampler(self, path: str | None, owner: str | None) -> str:
        sid = f"sampler-{uuid.uuid4().hex[:12]}"
        if self.backend.store is not None:
            self.backend.store.save_sampler(sid, path, owner)
        self.samplers[sid] = (path, owner)
        return sid

    def _sampler(self, request, sid: str) -> str | None:
        """The weights path of the caller's sampling session (None: the base model); sessions
        made by an earlier run of the server come from its store."""
        if sid not in self.samplers and self.backend.store is not None:
            record = self.backend.store.sampler(sid)
            if record is not None:
                self.samplers[sid] = (record["model_path"], record["owner"])
        if sid not in self.samplers or not self._allowed(request, self.samplers[sid][1]):
            raise NotFound(f"unknown sampler {sid!r}")
        if sid in self.inflight_sessions:  # the client's latest inflight save
            return self.inflight[self.inflight_sessions[sid]]
        return self.samplers[sid][0]

    async def create_sampling_session(self, request):
        body = await _body(request)
        path = body.get("model_path")
        if path is not None:
            self._snapshot(request, path)
        else:
            self._check_base(body.get("base_model"))
        sid = self._new_sampler(path, self._owner(request))
        return web.json_response({"type": "create_sampling_session",
                                  "sampling_session_id": sid})

    async def get_sampler(self, request):
        sid = request.match_info["sid"]
        return web.json_response({"sampler_id": sid, "base_model": self.backend.name,
                                  "model_path": self._sampler(request, sid)})

    async def asample(self, request):
        body = await _body(request)
        for key in ("topk_sample_logprobs", "prompt_alt_tokens_k"):
            if body.get(key):
                raise UserError(f"sample: {key} is not supported by this server")
        # the limits first: nothing is looked up or queued for a request that cannot be served
        req = SampleRequest.parse(body, self.limits, self.backend.max_len,
                                  self.backend.cfg.vocab_size)
        self.backend.stop_text(req.stop)  # refused here (no tokenizer), not after queueing
        if body.get("sampling_session_id") is not None:
            path = self._sampler(request, body["sampling_session_id"])
        elif body.get("model_path") is not None:
            path = body["model_path"]
        else:
            self._check_base(body.get("base_model"))
            path = None
        snap = None if path is None else self._snapshot(request, path)
        prompt_lp_from = _prompt_logprobs_from(body, len(req.prompt))
        topk = requested_k(body, self.backend.cfg.vocab_size)  # topk_prompt_logprobs
        targets = requested_targets(body, len(req.prompt), self.backend.cfg.vocab_size)

        def run_many(items):  # queued requests of one sample_key: one decode batch, in steps
            steps = self.backend.sample_steps([(snap, prompt, params, stop)
                                               for snap, prompt, params, stop, *_ in items])
            for done in steps:
                for i, d in done.items():  # record_stability_info: record before answering
                    if items[i][5] is not None and not isinstance(d, Exception):
                        items[i][5]([(c.tokens, c.logprobs) for c in d])
                yield {i: d if isinstance(d, Exception) else with_scores(encode_sample_response(
                    [(c.tokens, c.logprobs, c.finish_reason) for c in d],
                    _prompt_logprobs(self.backend, *items[i][:2], items[i][4])),
                    self.backend, *items[i][:2], items[i][6], items[i][4], items[i][7])
                    for i, d in done.items()}

        seq_ids = [f"seq-{uuid.uuid4().hex[:12]}" for _ in range(req.params.n)]
        record = (functools.partial(self.stability.record, seq_ids, self._owner(request),
                                    req.prompt) if body.get("record_stability_info") else None)
        item = (snap, req.prompt, req.params, req.stop, prompt_lp_from, record, topk,
                targets)
        # the base model or full parameters: a batch of its own
        key = self.backend.sample_key(snap) or ("sample", "alone", next(self._ids))
        return self.submit(request, run_many, item, key=key, cancellable=True,
                           sample_sequence_ids=seq_ids)

    # ------------------------------------------------------------------------------ the app

    def app(self) -> web.Application:
        ok = lambda payload: (lambda request: _json(payload))
        app = web.Application(middlewares=[self.middleware],
                              client_max_size=self.limits.max_body_bytes)
        v1 = "/api/v1"
        app.add_routes([
            web.get(f"{v1}/healthz", ok({"status": "ok"})),
            web.get(f"{v1}/get_server_capabilities", self.capabilities),
            web.post(f"{v1}/client/config", self.client_config),
            web.post(f"{v1}/client/dynamic_config", ok({"sample_cancel_enabled": True})),
            web.post(f"{v1}/create_session", self.create_session),
            web.post(f"{v1}/sessions/{{sid}}/finish", self.finish_session),
            web.post(f"{v1}/session_heartbeat", ok({"type": "session_heartbeat"})),
            web.post(f"{v1}/telemetry", ok({"status": "accepted"})),
            web.post(f"{v1}/get_info", self.get_info),
            web.post(f"{v1}/create_model", self.create_model),
            web.post(f"{v1}/forward_backward", self.forward_backward),
            web.post(f"{v1}/optim_step", self.optim_step),
            web.post(f"{v1}/save_weights", self.save_weights),
            web.post(f"{v1}/load_weights", self.load_weights),
            web.post(f"{v1}/save_weights_for_sampler", self.save_weights_for_sampler),
            web.post(f"{v1}/create_sampling_session", self.create_sampling_session),
            web.get(f"{v1}/samplers/{{sid}}", self.get_sampler),
            web.post(f"{v1}/asample", self.asample),
            web.post(f"{v1}/retrieve_future", self.retrieve_future),
            web.post(f"{v1}/cancel_future", self.cancel_future),
        ])
        rest = Rest(self)  # the RestClient's routes: runs, checkpoints, external weights
        app.add_routes(rest.routes())
        app.cleanup_ctx.append(rest.sweeper)
        return app


async def _json(payload):
    return web.json_response(payload)


def _key_id(request: web.Request) -> str:
    """The request's key as the logs name it: its owner hash (never the key itself)."""
    key = request.headers.get("X-API-Key")
    return "no key" if key is None else owner_of(key)


def _prompt_logprobs_from(body: dict, prompt_len: int) -> int | None:
    """The first prompt position whose log-probability is returned (None: none are): 0, or
    `len(prompt) - prompt_logprobs_last_n`."""
    last_n = body.get("prompt_logprobs_last_n")
    if not body.get("prompt_logprobs"):
        if last_n is not None:
            raise UserError("sample: prompt_logprobs_last_n needs prompt_logprobs=True")
        return None
    if last_n is None:
        return 0
    if not isinstance(last_n, int) or not 1 <= last_n <= prompt_len - 1:
        raise UserError(f"sample: prompt_logprobs_last_n must be an integer in 1..len(prompt) "
                        f"- 1 = {prompt_len - 1}, got {last_n!r}")
    return prompt_len - last_n


def _prompt_logprobs(backend: Backend, snap, prompt: list[int], start: int | None):
    """The prompt's log-probabilities from position `start` on (NaN before it: the SDK's None);
    None when not asked for."""
    if start is None:
        return None
    logp = backend.prompt_logprobs(snap, prompt)
    logp[:start] = float("nan")
    return logp


async def _body(request: web.Request) -> dict:
    """The request's JSON body, which must be an object (read within the body size limit)."""
    return json_object(await request.read(), request.path.rsplit("/", 1)[-1])
