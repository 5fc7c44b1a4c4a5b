"""One frozen base, many LoRA training clients: the compute behind the Tinker service.

A training client is a `TrainingModel`: its adapters (`*_lora_a` / `*_lora_b`, pure dicts), its
optax Adam state, its accumulated gradients. The base is held once (`Backend.base`) and joined to a
client's adapters inside each jitted function (`lora.join`), so clients share the base and its
compiled functions (one per adapter layout and loss), never each other's state: a client's
arrays are only read and written by its own requests.

`forward_backward` adds the gradient of the summed loss to the client's accumulator (Tinker's
semantics: several calls then one `optim_step`); `optim_step` applies Adam with the request's
hyper-parameters and clears it. Sampling goes through jaxrl's own engine and scheduler: one
`JaxEngine` per adapter layout with the snapshot's weights swapped in, and for queued requests
of several LoRA snapshots of one layout (`sample_many`) one `MultiLoraEngine` run that decodes
their different adapters in one batch.
Every method runs on the server's single worker thread (see `server.py`).
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import os
import uuid

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.config import LoraConfig, ModelConfig
from jaxrl.generate.engine import JaxEngine
from jaxrl.generate.multi_lora import MultiLoraEngine
from jaxrl.generate.sampling import SamplingParams
from jaxrl.generate.scheduler import Scheduler
from jaxrl.generate.stops import StopText
from jaxrl.models import lora
from jaxrl.models.hf import load_pretrained
from jaxrl.models.hub import resolve
from jaxrl.models.model import abstract_model
from jaxrl.models.transformer import Transformer
from jaxrl.presets import tiny_model_config, tiny_task_model_config
from jaxrl.rounding import next_power_of_two
from jaxrl.service import compute
from jaxrl.service.checkpoints import Checkpoints
from jaxrl.service.store import BadPath, Store, parse_path
from jaxrl.service.wire import ForwardBackwardRequest
from jaxrl.tokenizers import CharTokenizer, load_tokenizer
from jaxrl.train import tinker

ATTN, MLP = ("q", "k", "v", "o"), ("gate", "up", "down")
# LoRA alpha of the service's adapters (scale alpha / rank), as tinker-cookbook assumes
# (`hyperparam_utils`' lora_alpha=32), LoRA Without Regret used and SkyRL tx sets; jaxrl's own
# default is 16, which at the same learning rate moves the adapters' product about half as far
# per Adam step (docs/service.md)
LORA_ALPHA = 32.0
_copy = functools.partial(jax.tree.map, jnp.copy)


class UserError(ValueError):
    """A request the server rejects (reported to the client as a user error)."""


class NotFound(UserError):
    """A model id or weights path the server does not know."""


@dataclasses.dataclass
class TrainingModel:
    model_id: str
    lora: LoraConfig
    graphdef: nnx.GraphDef
    adapters: dict
    opt_state: tuple  # optax's (a NamedTuple): `jaxrl.train.tinker.adam_state`
    steps: int = 0
    grads: dict | None = None


@dataclasses.dataclass(frozen=True)
class Snapshot:
    """Saved weights: a copy of the adapters (and optimiser state for `save_state`)."""

    lora: LoraConfig | None
    graphdef: nnx.GraphDef
    adapters: dict
    mu: dict | None = None
    nu: dict | None = None
    steps: int = 0


def lora_config(rank: int, train_attn: bool = True, train_mlp: bool = True) -> LoraConfig:
    targets = (ATTN if train_attn else ()) + (MLP if train_mlp else ())
    if not targets:
        raise UserError("LoRA needs train_attn or train_mlp (jaxrl has no unembedding adapter)")
    if not isinstance(rank, int) or rank < 1:
        raise UserError(f"lora rank must be an integer >= 1, got {rank!r}")
    return LoraConfig(rank=rank, alpha=LORA_ALPHA, targets=targets)


# ----------------------------------------------------------------------------- the backend


class Backend:
    """The base model, the training clients and the saved weights of one server."""

    def __init__(self, cfg: ModelConfig, base: dict, name: str, *, max_len: int = 512,
                 num_slots: int = 8, eos_ids=(), max_batch_tokens: int = 65536,
                 state_dir: str | os.PathLike | None = None, max_adapters: int = 8,
                 tokenizer=None):
        """`state_dir`: where saved weights are written (they then survive a restart); None
        keeps them in memory only. `max_adapters`: LoRA snapshots decoded in one batch.
        `tokenizer`: the base model's (jaxrl's `load_tokenizer`), for stop strings; None: the
        server takes stop token ids only."""
        self.cfg, self.base, self.name = cfg, base, name
        self.decode = None if tokenizer is None else text_decoder(tokenizer)
        self.store = None if state_dir is None else Store(state_dir)
        self.checkpoints = Checkpoints(self.store)  # when saved, TTLs, published, deletion
        self.epoch = uuid.uuid4().hex[:8]  # model ids stay unique across restarts
        max_len = min(max_len, cfg.max_position_embeddings)
        self.max_len, self.num_slots, self.eos_ids = max_len, num_slots, tuple(eos_ids)
        self.max_batch_tokens = max_batch_tokens
        self.models: dict[str, TrainingModel] = {}
        self.snapshots: dict[str, Snapshot] = {}
        self._engines: dict = {}
        self._graphs: dict = {}  # LoRA layout -> its graphdef
        self._multi: dict = {}  # LoRA layout -> (MultiLoraEngine, ids of its snapshots, weights)
        self.max_adapters = max_adapters
        self.sample_runs = self.sampled_requests = 0  # scheduler runs, the requests they served
        self._ids = itertools.count()
        self.base_graphdef = nnx.split(abstract_model(cfg))[0]

    @classmethod
    def load(cls, ref: str, **kw) -> Backend:
        """`ref`: "tiny" / "tiny-task" (random `presets` models with the char tokenizer's EOS:
        tests and demos), a local Hugging Face directory or a Hub id."""
        if ref in ("tiny", "tiny-task"):
            cfg = tiny_model_config() if ref == "tiny" else tiny_task_model_config()
            base = nnx.to_pure_dict(nnx.state(Transformer(cfg, rngs=nnx.Rngs(0))))
            tok = load_tokenizer("char")
            return cls(cfg, base, ref, eos_ids=tok.eos_ids, tokenizer=tok, **kw)
        path = resolve(ref, what="--base-model")
        cfg, model = load_pretrained(path)
        tok = None
        try:
            tok = load_tokenizer(str(path))
        except Exception:  # noqa: BLE001 - no tokenizer: sample to max_tokens, stop ids only
            pass
        base = lora.split(nnx.to_pure_dict(nnx.state(model)))[0]
        eos = () if tok is None else tuple(tok.eos_ids)
        return cls(cfg, base, ref.rstrip("/"), eos_ids=eos, tokenizer=tok, **kw)

    # ------------------------------------------------------------------ training clients

    def _graph(self, lcfg: LoraConfig | None):
        """The model's graph with `lcfg`'s adapters (traced once per layout: ~0.3 s)."""
        if lcfg is None:
            return self.base_graphdef
        if lcfg not in self._graphs:
            mcfg = dataclasses.replace(self.cfg, lora=lcfg)
            self._graphs[lcfg] = nnx.split(abstract_model(mcfg))[0]
        return self._graphs[lcfg]

    def _init_adapters(self, lcfg: LoraConfig, seed):
        """A fresh model's LoRA adapters for `lcfg` (`seed`: an int, or a traced uint32; the key
        is `jax.random.key(seed)` either way, as `nnx.Rngs(seed)` makes it)."""
        mcfg = dataclasses.replace(self.cfg, lora=lcfg)
        rngs = nnx.Rngs(jax.random.key(seed))
        return lora.split(nnx.to_pure_dict(nnx.state(Transformer(mcfg, rngs=rngs))))[1]

    @functools.cached_property
    def _jit_init(self):
        """`_init_adapters` jitted with the layout static and the seed traced: one compile per
        adapter layout, so a second client of a layout met before compiles nothing (a fresh
        `functools.partial` per seed recompiled on every `create`: issue 48)."""
        return jax.jit(self._init_adapters, static_argnums=0)

    def _add(self, lcfg: LoraConfig | None, graphdef, params, model_id: str | None = None
             ) -> str:
        """A new training client of these weights, fresh Adam; `model_id`: its id, None: new."""
        if model_id is None:
            model_id = f"run-{self.epoch}-{next(self._ids)}"
        elif model_id in self.models:
            raise UserError(f"model_id {model_id!r} already exists")
        self.models[model_id] = TrainingModel(model_id, lcfg, graphdef, params,
                                              tinker.adam_state(params))
        return model_id

    def create(self, lcfg: LoraConfig, seed: int | None = None) -> str:
        seed = int.from_bytes(os.urandom(4), "little") if seed is None else int(seed)
        adapters = self._jit_init(lcfg, np.uint32(seed % 2**32))
        return self._add(lcfg, self._graph(lcfg), adapters)

    def create_from_state(self, path: str, with_optimizer: bool, model_id: str | None = None
                          ) -> str:
        """A training client whose weights (LoRA adapters, or all parameters) are the save at
        `path`, its layout the save's; with its Adam moments and step count `with_optimizer`
        (the save must hold them), else a fresh Adam. `model_id`: the id to give it (the SDK
        names a client it creates this way itself)."""
        s = self.snapshot(path)
        if with_optimizer and s.mu is None:
            raise UserError(f"{path} holds no optimizer state (save_weights_for_sampler saves "
                            "weights only); load it without the optimizer, or use a save_state "
                            "path")
        model_id = self._add(s.lora, s.graphdef, s.adapters, model_id)
        self.load_state(model_id, path, with_optimizer)  # copies the save's arrays
        return model_id

    def create_full(self) -> str:
        """A full-parameter training client (the server's `--full-params` mode): its `adapters`
        are a copy of every base parameter and `lora` is None, so `lora.join(base, adapters)` is
        that copy and the same loss, Adam, save and sampling paths train and serve all of it."""
        return self._add(None, self.base_graphdef, _copy(self.base))

    def get(self, model_id: str) -> TrainingModel:
        if model_id not in self.models:
            raise NotFound(f"unknown model_id {model_id!r}; this server holds "
                           f"{sorted(self.models) or 'no models'} (training clients do not "
                           "survive a server restart: create one and load_state a saved path)")
        return self.models[model_id]

    def check(self, req: ForwardBackwardRequest) -> None:
        """Reject a malformed batch before it is queued (shapes, ids, loss, size)."""
        self.get(req.model_id)
        if req.loss_fn not in tinker.LOSSES:
            raise UserError(f"loss_fn {req.loss_fn!r} is not supported; this server has "
                            f"{sorted(tinker.LOSSES)}")
        _, required, optional, defaults = tinker.LOSSES[req.loss_fn]
        unknown = sorted(set(req.config) - set(defaults))
        if unknown:
            raise UserError(f"loss_fn_config keys {unknown} are not used by {req.loss_fn}; "
                            f"valid: {sorted(defaults)}")
        if not req.data:
            raise UserError("forward_backward needs at least one datum")
        total = sum(len(d.tokens) for d in req.data)
        if total > self.max_batch_tokens:
            raise UserError(f"batch of {total} tokens exceeds the server's max_batch_tokens "
                            f"({self.max_batch_tokens}); split it")
        vocab = self.cfg.vocab_size
        for i, d in enumerate(req.data):
            n = len(d.tokens)
            if not 0 < n <= self.max_len:
                raise UserError(f"datum {i}: {n} tokens; need 1..{self.max_len}")
            for key in ("target_tokens", *required):
                if key not in d.inputs:
                    raise UserError(f"datum {i}: loss_fn {req.loss_fn} needs loss_fn_inputs "
                                    f"{key!r}; got {sorted(d.inputs)}")
            unread = sorted(set(d.inputs) - {"target_tokens", *required, *optional,
                                             *tinker.SENT_NOT_READ.get(req.loss_fn, ())})
            if unread:
                raise UserError(f"datum {i}: loss_fn_inputs {unread} are not read by "
                                f"{req.loss_fn}; it reads target_tokens, "
                                f"{', '.join(sorted({*required, *optional}))}")
            for key, arr in d.inputs.items():
                if arr.shape != (n,):
                    raise UserError(f"datum {i}: loss_fn_inputs {key!r} has shape "
                                    f"{list(arr.shape)}; expected [{n}] (one per input token)")
            targets = d.inputs["target_tokens"]
            for what, ids in (("model_input", d.tokens), ("target_tokens", targets)):
                if ids.min() < 0 or ids.max() >= vocab:
                    raise UserError(f"datum {i}: {what} has token ids outside [0, {vocab})")

    def batch_key(self, req: ForwardBackwardRequest) -> tuple:
        """Requests with equal keys run in one `forward_backward_many` call: same adapter
        layout, loss and direction, and the same padded batch shape, so batch-mates add only the
        leading adapter axis, never change an adapter's own shapes. A full-parameter client's
        requests (lora None) get a key of their own: N stacked copies of a whole model are not
        worth the memory."""
        m = self.get(req.model_id)
        if m.lora is None:
            return ("forward_backward", "alone", id(req))
        return ("forward_backward", m.graphdef, req.loss_fn, req.forward_only,
                *self._padded_shape(req))

    @staticmethod
    def _padded_shape(req: ForwardBackwardRequest) -> tuple[int, int]:
        return (next_power_of_two(len(req.data)),
                next_power_of_two(max(len(d.tokens) for d in req.data), minimum=16))

    def forward_backward(self, req: ForwardBackwardRequest):
        """(per-datum outputs, metrics); adds the gradient to the client's accumulator unless
        `req.forward_only`."""
        return self.forward_backward_many([req])[0]

    def forward_backward_many(self, reqs: list[ForwardBackwardRequest]) -> list:
        """`forward_backward` of several requests (equal `batch_key`s; any clients, the same
        client more than once) in as few jitted steps as `max_batch_tokens` allows (padded
        tokens per step; one request at least); results in order, each what the request gets
        alone (to f32 tolerance). Gradients are added to the accumulators in request order."""
        if len({self.batch_key(r) for r in reqs}) != 1:
            raise ValueError("forward_backward_many needs requests with one batch_key")
        b, t = self._padded_shape(reqs[0])
        per_step = 1 << (max(1, self.max_batch_tokens // (b * t)).bit_length() - 1)
        results = []
        for i in range(0, len(reqs), per_step):
            results += self._step_many(reqs[i:i + per_step])
        return results

    def _step_many(self, reqs: list[ForwardBackwardRequest]) -> list:
        """One jitted step of `forward_backward_many`. The adapter axis is padded to a power of
        two (repeats of the first request, discarded) to bound compiles."""
        models = [self.get(r.model_id) for r in reqs]
        loss_fn, forward_only = reqs[0].loss_fn, reqs[0].forward_only
        _, required, optional, defaults = tinker.LOSSES[loss_fn]
        n = next_power_of_two(len(reqs))
        b, t = self._padded_shape(reqs[0])
        tokens = np.zeros((n, b, t), np.int32)
        targets = np.zeros((n, b, t), np.int32)
        mask = np.zeros((n, b, t), np.float32)
        inputs = {k: np.zeros((n, b, t), np.float32) for k in (*required, *optional)}
        cfg = {k: np.zeros(n, np.float32) for k in defaults}
        for j in range(n):
            req = reqs[j if j < len(reqs) else 0]
            for i, d in enumerate(req.data):
                m = len(d.tokens)
                tokens[j, i, :m], targets[j, i, :m] = d.tokens, d.inputs["target_tokens"]
                mask[j, i, :m] = 1
                for k in inputs:  # `check` saw the required ones
                    inputs[k][j, i, :m] = d.inputs.get(k, optional.get(k))
            for k, v in defaults.items():
                cfg[k][j] = req.config.get(k, v)
        picks = tuple(models[j if j < len(reqs) else 0].adapters for j in range(n))
        args = (picks, self.base, tokens, targets, mask, inputs, cfg)
        out = compute.jitted_loss(models[0].graphdef, loss_fn, not forward_only)(*args)
        if forward_only:
            loss, (logp, per_tok) = out
        else:
            (loss, (logp, per_tok)), grads = out
            for m, g in zip(models, grads, strict=False):  # padding's gradients dropped
                m.grads = g if m.grads is None else compute.accumulate(m.grads, g)
        loss, logp, per_tok = np.asarray(loss), np.asarray(logp), np.asarray(per_tok)
        results = []
        for j, req in enumerate(reqs):
            outputs = [{"logprobs": logp[j, i, :len(d.tokens)].astype(np.float32),
                        "elementwise_loss": per_tok[j, i, :len(d.tokens)].astype(np.float32)}
                       for i, d in enumerate(req.data)]
            results.append((outputs, {"loss:sum": float(loss[j])}))
        return results

    def optim_step(self, model_id: str, adam: dict) -> dict:
        """Adam on the accumulated gradient, the request's `AdamParams` set in the optax state."""
        m = self.get(model_id)
        m.opt_state.hyperparams.update(
            {k: jnp.float32(float(adam.get(k, v))) for k, v in tinker.ADAM_DEFAULTS.items()})
        if m.grads is None:  # nothing accumulated: Adam with a zero gradient
            m.grads = lora.zeros_like(m.adapters)
        m.adapters, m.opt_state, gnorm = tinker.adam_update(m.adapters, m.grads, m.opt_state)
        m.steps, m.grads = m.steps + 1, None
        return {"grad_norm:mean": float(gnorm)}

    # ---------------------------------------------------------------------- saved weights

    def saved(self, path: str) -> bool:
        """Whether live (not deleted, not expired) weights are saved at `path`."""
        return self.checkpoints.info(path) is not None

    def save(self, model_id: str, kind: str, name: str | None, with_optimizer: bool,
             overwrite: bool = True, ttl_seconds: int | None = None,
             user_metadata: dict | None = None) -> str:
        """Snapshot the client's adapters (and Adam state `with_optimizer`) as
        tinker://<model_id>/<kind>/<name>; written to disk (atomically) when there is a store.
        Not `overwrite`: a save already at that path is refused. `ttl_seconds`: it is deleted
        that long after (`checkpoints.py`)."""
        m = self.get(model_id)
        name = name or f"{kind}-{next(self._ids)}"
        path = f"tinker://{model_id}/{kind}/{name}"
        try:
            parse_path(path)
        except BadPath as e:
            raise UserError(f"save: {e}") from e
        if not overwrite and self.saved(path):
            raise UserError(f"save_state: {path} exists; pass overwrite=True to replace it")
        mu, nu = _copy(tinker.adam_moments(m.opt_state)) if with_optimizer else (None, None)
        snap = Snapshot(m.lora, m.graphdef, _copy(m.adapters), mu, nu, m.steps)
        if self.store is not None:
            trees = {"adapters": snap.adapters}
            if with_optimizer:
                trees.update(mu=snap.mu, nu=snap.nu)
            lc = m.lora
            meta = {"base_model": self.name, "steps": m.steps, "lora": None if lc is None else {
                "rank": lc.rank, "alpha": lc.alpha, "targets": list(lc.targets),
                "rslora": lc.rslora}}
            self.store.save_weights(path, meta, trees)
        self.snapshots[path] = snap
        self.checkpoints.record(path, ttl_seconds, user_metadata)
        return path

    def delete(self, path: str) -> int:
        """Delete the checkpoint at `path` (files, record, cached weights); the bytes freed."""
        self.snapshots.pop(path, None)
        return self.checkpoints.delete(path)

    def snapshot(self, path: str) -> Snapshot:
        """Saved weights by path: from memory, else from the store (an earlier run's save).
        A checkpoint deleted or expired (then deleted here) is not found."""
        expired = self.checkpoints.expired(path)
        if expired or self.checkpoints.info(path) is None:
            held = self.snapshots.pop(path, None) is not None
            why = " (its ttl_seconds ran out: deleted)" if expired else " (deleted)" if held else ""
            raise NotFound(f"unknown weights path {path!r}{why}")
        if path in self.snapshots:
            return self.snapshots[path]
        loaded = None
        if self.store is not None:
            try:
                loaded = self.store.load_weights(path, self._saved_shapes)
            except BadPath:
                pass
        if loaded is None:
            raise NotFound(f"unknown weights path {path!r}")
        meta, trees = loaded
        if meta["base_model"] != self.name:
            raise UserError(f"{path} was trained on base model {meta['base_model']!r}; this "
                            f"server serves {self.name!r}")
        lc = _saved_lora(meta)
        put = lambda t: None if t is None else jax.tree.map(jnp.asarray, t)
        snap = Snapshot(lc, self._graph(lc), put(trees["adapters"]), put(trees.get("mu")),
                        put(trees.get("nu")), int(meta["steps"]))
        self.snapshots[path] = snap
        return snap

    def _saved_shapes(self, meta: dict) -> dict:
        lc = _saved_lora(meta)
        if lc is None:  # a full-parameter save: every base parameter
            shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), self.base)
        else:
            shapes = jax.eval_shape(functools.partial(self._init_adapters, lc, 0))
        return {"adapters": shapes, "mu": shapes, "nu": shapes}

    def load_state(self, model_id: str, path: str, with_optimizer: bool) -> None:
        m, s = self.get(model_id), self.snapshot(path)
        if s.lora != m.lora:
            raise UserError(f"{path} has LoRA {s.lora}, model {model_id} has {m.lora}")
        m.adapters, m.grads = _copy(s.adapters), None
        if with_optimizer and s.mu is not None:
            m.opt_state, m.steps = tinker.adam_state(m.adapters, s.mu, s.nu, s.steps), s.steps

    # --------------------------------------------------------------------------- sampling

    def engine(self, snap: Snapshot | None) -> JaxEngine:
        """The engine for a snapshot's adapter layout (the base model for None), its weights
        swapped in."""
        key = None if snap is None else snap.lora
        graphdef = self.base_graphdef if snap is None else snap.graphdef
        params = self.base if snap is None else lora.join(self.base, snap.adapters)
        model = nnx.merge(graphdef, params)
        if key not in self._engines:
            self._engines[key] = JaxEngine(model, num_slots=self.num_slots, max_len=self.max_len,
                                           eos_ids=self.eos_ids)
        else:
            self._engines[key].set_params(model, 0)
        return self._engines[key]

    def sample(self, snap: Snapshot | None, prompt: list[int], params: SamplingParams,
               stop: tuple[str, ...] = ()):
        result = self.sample_many([(snap, prompt, params, stop)])[0]
        if isinstance(result, Exception):
            raise result
        return result

    def sample_key(self, snap: Snapshot | None) -> tuple | None:
        """Queued `sample` requests with equal keys run in one `sample_many` call: LoRA
        snapshots of one layout. None (the base model, a full-parameter snapshot): alone."""
        return None if snap is None or snap.lora is None else ("sample", snap.lora)

    def sample_many(self, items: list[tuple]) -> list:
        """Each `(snapshot, prompt, params[, stop])`'s completions (ordered by sample index), or
        the `UserError` that rejects it: `sample_steps` run to its end."""
        results: list = [None] * len(items)
        for done in self.sample_steps(items):
            for i, result in done.items():
                results[i] = result
        return results

    def sample_steps(self, items: list[tuple]):
        """`sample_many` one decode chunk at a time: a generator that yields, after each chunk,
        `{index: completions or UserError}` of the items it finished (the server's worker runs
        other requests between chunks). `stop`: stop strings (`stop_text`). Items of one
        snapshot share one scheduler run on that snapshot's engine; of several snapshots (equal
        `sample_key`s), one run of a `MultiLoraEngine` per `max_adapters` of them, each request
        on its own adapter. Other runs may use the engine between two chunks: its weights are
        put back before each chunk."""
        snaps = list({id(item[0]): item[0] for item in items}.values())
        if len(snaps) > 1 and len({self.sample_key(s) for s in snaps}) != 1:
            raise ValueError("sample_many needs snapshots of one sample_key")
        for g in range(0, len(snaps), self.max_adapters):
            group = snaps[g:g + self.max_adapters]
            index = {id(s): j for j, s in enumerate(group)}
            engine = self.engine(group[0]) if len(group) == 1 else self._multi_engine(group)
            weights, scheduler = engine.params, Scheduler(engine)
            rid, rejected, got = {}, {}, {}
            for i, (snap, prompt, params, *stop) in enumerate(items):
                if id(snap) not in index:
                    continue
                kw = {} if len(group) == 1 else {"adapter": index[id(snap)]}
                try:
                    kw["stop_text"] = self.stop_text(stop[0] if stop else ())
                    rid[scheduler.submit(prompt, params, **kw)] = i
                    got[i] = []
                except ValueError as e:  # the engine's checks: prompt, ids, KV cache room
                    rejected[i] = UserError(str(e))
            self.sample_runs += 1
            self.sampled_requests += len(rid)
            if rejected:
                yield rejected
            while scheduler.has_work():
                engine.params = weights  # another run may have swapped its own in
                done = {}
                for c in scheduler.step():
                    i = rid[c.request_id]
                    got[i].append(c)
                    if len(got[i]) == items[i][2].n:
                        done[i] = sorted(got[i], key=lambda c: c.sample_index)
                yield done

    def stop_text(self, strings: tuple[str, ...]) -> StopText | None:
        """Stop strings as the scheduler's host-side check on decoded text (None: no strings).
        The sample keeps the token that completes a string, as Tinker returns it (a
        tinker-cookbook renderer splits its decoded sample on the stop string)."""
        if not strings:
            return None
        if self.decode is None:
            raise UserError(f"sample: stop strings need the base model's tokenizer, and "
                            f"{self.name!r} has none (no tokenizer.json beside its weights); "
                            "pass stop token ids")
        return StopText(tuple(strings), self.decode)

    def _multi_engine(self, snaps: list[Snapshot]) -> MultiLoraEngine:
        """The multi-adapter engine of the snapshots' layout, holding their adapters in order
        (swapped in only when the set differs from the one it holds)."""
        key = snaps[0].lora
        if key not in self._multi:
            model = nnx.merge(snaps[0].graphdef, lora.join(self.base, snaps[0].adapters))
            engine = MultiLoraEngine(model, max_adapters=self.max_adapters,
                                     num_slots=self.num_slots, max_len=self.max_len,
                                     eos_ids=self.eos_ids)
            self._multi[key] = (engine, None, None)
        engine, held, weights = self._multi[key]
        ids = tuple(id(s) for s in snaps)
        if held != ids or engine.params is not weights:  # (a stepped run may have swapped)
            engine.set_adapters(self.base, [s.adapters for s in snaps])
            self._multi[key] = (engine, ids, engine.params)
        return engine

    def prompt_logprobs(self, snap: Snapshot | None, prompt: list[int]) -> np.ndarray:
        """log p(prompt[t] | prompt[:t]); NaN at t = 0 (no context)."""
        graphdef = self.base_graphdef if snap is None else snap.graphdef
        adapters = {} if snap is None else snap.adapters
        t = next_power_of_two(len(prompt), minimum=16)
        tokens = np.zeros((1, t), np.int32)
        targets = np.zeros((1, t), np.int32)
        tokens[0, :len(prompt)] = prompt
        targets[0, :len(prompt) - 1] = prompt[1:]
        logp = np.asarray(compute.jit_logprobs(graphdef)(adapters, self.base, tokens, targets))[0]
        return np.concatenate([[np.nan], logp[:len(prompt) - 1]]).astype(np.float32)

    def info(self) -> dict:
        return {"model_name": self.name, "max_context_length": self.max_len}


def text_decoder(tokenizer):
    """`decode(ids) -> str` for stop strings: special tokens kept (a stop string may be one's
    text), and each id past the tokenizer's vocabulary (a padded embedding row) one U+FFFD, so
    every id adds text (`StopText` looks back a window of ids as long as the string's bytes)."""
    if isinstance(tokenizer, CharTokenizer):
        return functools.partial(tokenizer.decode, stop_at_eos=False, errors="replace")

    def decode(ids):
        text, run = [], []
        for i in map(int, ids):
            if 0 <= i < tokenizer.vocab_size:
                run.append(i)
                continue
            text += [tokenizer.decode(run, skip_special_tokens=False), "\ufffd"]
            run = []
        return "".join(text) + tokenizer.decode(run, skip_special_tokens=False)

    return decode


def _saved_lora(meta: dict) -> LoraConfig | None:
    """The LoRA config a save was made with (None: full parameters)."""
    lc = meta["lora"]
    return None if lc is None else LoraConfig(**{**lc, "targets": tuple(lc["targets"])})
