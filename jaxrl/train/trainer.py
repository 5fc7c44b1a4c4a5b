"""`Trainer`: the host-side owner of the TrainState and the jitted functions.

    trainer = Trainer(model_cfg, train_cfg, meshes.trainer)        # or params=... to start from
    metrics = trainer.step(batch)    # this step's metrics (host floats)

`step` pads the batch to a fixed shape, fills in proximal / reference logprobs when the config
needs them (`prepare`), dispatches the jitted update(s), waits for them and reads their metrics.
The RL loop needs the updated params at once (the weight sync moves them), so waiting costs
nothing there; the read-back is a handful of scalars. A NaN/Inf loss or gradient stops the run
(`NonFiniteError`) unless `train.nan_policy="skip"`; the bad update is never applied either way.

`train/step_s` is the trainer's own time: from dispatch to the moment the step's outputs were
ready.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh

from jaxrl.config import ModelConfig, TrainConfig
from jaxrl.models import lora
from jaxrl.rounding import round_up
from jaxrl.train.batch import Batch, check_batch, pad_batch, padded_shape
from jaxrl.train.flops import mfu, peak_flops, train_flops_per_token
from jaxrl.train.logprobs import make_logprobs_fn
from jaxrl.train.minibatch import (
    combine_update_metrics,
    padded_update,
    plan_updates,
    take_host_rows,
    take_rows,
)
from jaxrl.train.objective import correction_needs
from jaxrl.train.prefix import PrefixLayout, plan_prefix_layout
from jaxrl.train.state import (
    TrainState,
    frozen_shardings,
    init_frozen,
    init_train_state,
    model_graphdef,
    train_state_shardings,
)
from jaxrl.train.step import batch_shardings, layout_shardings, make_train_step

# The shortest padded batch length; longer ones follow `padded_shape`'s buckets (16, 24, 32, 48,
# ...). The lm-head chunk need not divide it: `logprobs.chunk_size` takes a divisor.
MIN_PADDED_LEN = 16


class NonFiniteError(FloatingPointError):
    pass


def frozen_copy(params: dict, shardings, dtype: str | None = None) -> dict:
    """A copy of `params` on `shardings` (cast to `dtype`) that shares no buffer with them: the
    train step donates the policy's buffers, never the reference's."""
    placed = jax.device_put(params, shardings)
    cast = jax.jit(lambda p: jax.tree.map(
        lambda x: x.astype(dtype or x.dtype) if jnp.issubdtype(x.dtype, jnp.floating)
        else x + 0, p))
    return cast(placed)


def tree_bytes(tree) -> int:
    return sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(tree))


class Trainer:
    def __init__(
        self,
        model_cfg: ModelConfig,
        train_cfg: TrainConfig,
        mesh: Mesh,
        *,
        params: dict | None = None,
        ref_params: dict | None = None,
        max_len: int | None = None,
        state: TrainState | None = None,
    ):
        param_dtype, compute_dtype = train_cfg.precision(
            model_cfg.param_dtype, model_cfg.dtype, mesh.devices.flat[0].platform)
        model_cfg = dataclasses.replace(model_cfg, param_dtype=param_dtype, dtype=compute_dtype)
        self.model_cfg, self.cfg, self.mesh = model_cfg, train_cfg, mesh
        self.graphdef, _ = model_graphdef(model_cfg, train_cfg)
        self.abstract_state, self.shardings = train_state_shardings(model_cfg, train_cfg, mesh)
        self.state = (
            state
            if state is not None
            else init_train_state(model_cfg, train_cfg, mesh, params=params)
        )
        # LoRA: the frozen base beside the state (whose params are the adapters)
        self.frozen = init_frozen(model_cfg, train_cfg, mesh, params=params)
        self.ref_params = None
        if train_cfg.needs_reference and self.frozen is not None and ref_params is None:
            # the reference is the base: zero adapters on the shared base, no second copy
            self.ref_params = lora.zeros_like(self.state.params)
        elif train_cfg.needs_reference:
            if ref_params is None:
                raise ValueError("train.kl_coef > 0 (or train.ref_metrics) needs ref_params, the "
                                 "frozen reference policy")
            self.ref_params = frozen_copy(ref_params, self.shardings.params, train_cfg.ref_dtype)
        self._step = make_train_step(self.graphdef, train_cfg, mesh, self.shardings)
        self._logprobs = make_logprobs_fn(self.graphdef, chunk=train_cfg.logprob_chunk)
        self._proximal_logprobs = make_logprobs_fn(self.graphdef, chunk=train_cfg.logprob_chunk,
                                                   replay=train_cfg.routing_replay)
        self.max_len = max_len
        self.row_multiple = train_cfg.micro_batches * mesh.shape["fsdp"]
        self.last_updates: list[dict] = []
        self._peak = None
        self.last_shared_fraction = 0.0  # of the last batch's tokens, computed once per group
        # the (batch, layout) shapes the step was called with, for `precompile_step`
        self.signatures: dict = {}

    # ---------------------------------------------------------------- batches
    def pad(self, batch: Batch) -> Batch:
        """Pad a host batch to the fixed shape for its size (rows and length buckets)."""
        b, t = batch.shape
        rows, length = padded_shape(
            b,
            t,
            row_multiple=self.row_multiple,
            min_len=min(self.cfg.logprob_chunk, MIN_PADDED_LEN),
            max_len=self.max_len,
        )
        return pad_batch(batch, rows, length)

    def logprobs(self, params: dict, batch: Batch, *, proximal: bool = False,
                 prefix: PrefixLayout | None = None) -> jax.Array:
        """Per-token logprobs of a (padded, device-placed) batch under `params` (the state's
        kind: with LoRA, adapters) (aligned as in `jaxrl.train.batch`). `proximal`: pi_old,
        routed as the policy's forward is (`train.routing_replay`); else the params' own
        routing (the reference policy). `prefix`: the batch's shared-prompt layout (then 0 at
        the prompt positions, which carry no loss)."""
        fn = self._proximal_logprobs if proximal else self._logprobs
        with jax.set_mesh(self.mesh):  # as in the train step (Pallas attention per shard)
            return fn(self.full_params(params), batch, prefix)

    def full_params(self, params: dict) -> dict:
        """The model's whole params dict for the state's `params` (LoRA: base + adapters)."""
        return params if self.frozen is None else lora.join(self.frozen, params)

    @property
    def uses_lora(self) -> bool:
        return self.frozen is not None

    def prepare(self, batch: Batch) -> Batch:
        """Check, pad and place a host batch; fill proximal / reference logprobs if needed."""
        return self._prepare(batch, share=False)[0]

    def _plan(self, host: Batch):
        """`plan_prefix_layout` of a padded host batch for this trainer's step, or None."""
        if not self.shares_prompts:
            return None
        return plan_prefix_layout(host, self.cfg.micro_batches,
                                  min_len=min(self.cfg.logprob_chunk, MIN_PADDED_LEN))

    def _place_layout(self, layout: PrefixLayout) -> PrefixLayout:
        return jax.device_put(layout, layout_shardings(layout, self.mesh))

    def _prepare(self, batch: Batch, *, share: bool):
        """`prepare`, with `share`: laid out for shared prompts where that pays (the rows then
        reordered; `jaxrl.train.prefix`). Returns the device batch, its placed layout (or
        None) and the padded host batch in the same row order."""
        check_batch(batch)
        host = batch = self.pad(batch)
        layout = None
        self.last_shared_fraction = 0.0
        planned = self._plan(batch) if share else None
        if planned is not None:
            host = batch = planned.batch
            layout = self._place_layout(planned.layout)
            self.last_shared_fraction = 1 - planned.computed_tokens / planned.batch_tokens
        batch = jax.device_put(batch, batch_shardings(batch, self.mesh))
        if "proximal" in correction_needs(self.cfg) and batch.proximal_logprobs is None:
            batch = batch.replace(proximal_logprobs=self.logprobs(
                self.state.params, batch, proximal=True, prefix=layout))
        if self.ref_params is not None and batch.ref_logprobs is None:
            batch = batch.replace(ref_logprobs=self.logprobs(self.ref_params, batch,
                                                             prefix=layout))
        return batch, layout, host

    @property
    def shares_prompts(self) -> bool:
        """Whether the step lays batches out for shared prompts (`train.share_prompts` and a
        dense model)."""
        mc = self.model_cfg
        return self.cfg.share_prompts and not any(
            mc.is_sparse_layer(i) for i in range(mc.num_layers))

    # ---------------------------------------------------------------- stepping
    @property
    def updates_per_batch(self) -> int:
        return self.cfg.mini_batches * self.cfg.epochs

    def step(self, batch: Batch, *, seed_step: int = 0) -> dict:
        """The updates of one batch (`train.mini_batches` x `train.epochs`, shuffled with a seed
        from `seed_step`); returns their metrics (host floats)."""
        real_tokens = int(np.sum(np.asarray(batch.segment_ids) > 0))
        dev_batch, layout, host = self._prepare(batch, share=True)
        start = time.perf_counter()
        if self.updates_per_batch == 1:
            metrics = [self._update(dev_batch, layout, rows=batch.shape[0])]
        else:
            metrics = self._several_updates(host, dev_batch, layout, seed_step)
        jax.block_until_ready((self.state, metrics))
        seconds = time.perf_counter() - start
        computed = round(real_tokens * (1 - self.last_shared_fraction))  # for the MFU
        return self._read(metrics, seconds, real_tokens * self.cfg.epochs, dev_batch.shape[1],
                          computed * self.cfg.epochs)

    def _several_updates(self, host: Batch, full: Batch, layout: PrefixLayout | None,
                         seed_step: int) -> list:
        """Updates on mini-batches of `full` (`host`: the padded host batch, rows in the same
        order; `layout`: its shared prompts or None), every ratio against the policy before the
        first (`jaxrl.train.minibatch`). Each mini-batch gets its own shared-prompt layout."""
        if full.proximal_logprobs is None:  # pi_old: the policy that generated the batch
            full = full.replace(proximal_logprobs=self.logprobs(self.state.params, full,
                                                                proximal=True, prefix=layout))
        valid = np.any(np.asarray(host.segment_ids) > 0, axis=1)
        plan = plan_updates(host.group_ids, valid, mini_batches=self.cfg.mini_batches,
                            epochs=self.cfg.epochs, seed=(self.cfg.seed, seed_step),
                            row_multiple=self.row_multiple)
        out, computed, total = [], 0, 0
        for update in plan.updates:
            idx, gid, keep = padded_update(update, plan.rows)
            mb_host = take_host_rows(host, idx, gid, keep)
            planned, mb_layout = self._plan(mb_host), None
            tokens = int(np.sum(mb_host.segment_ids > 0))
            total += tokens
            computed += tokens if planned is None else planned.computed_tokens
            if planned is not None:  # the rows in the planned order
                idx, gid, keep = idx[planned.order], gid[planned.order], keep[planned.order]
                mb_layout = self._place_layout(planned.layout)
            mb = take_rows(full, idx, gid, keep)
            mb = jax.device_put(mb, batch_shardings(mb, self.mesh))
            out.append(self._update(mb, mb_layout))
        self.last_shared_fraction = 1 - computed / max(total, 1)
        return out

    def _update(self, batch: Batch, layout: PrefixLayout | None, rows: int | None = None):
        """One jitted update (the state replaced); its shapes are remembered for
        `precompile_step`, with the batch's rows before padding (`rows`; None: as padded)."""
        shapes = jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype), (batch, layout))
        self.signatures.setdefault(str(shapes), (*shapes, rows))
        self.state, metrics = self._step(self.state, batch, self.frozen, layout)
        return metrics

    def _read(self, metrics: list, seconds: float, tokens: int, length: int,
              computed: int) -> dict:
        per_update = [{k: float(v) for k, v in m.items()} for m in jax.device_get(metrics)]
        self.last_updates = per_update  # each update's metrics of the batch
        host = per_update[0] if len(per_update) == 1 else combine_update_metrics(per_update)
        host["train/step_s"] = seconds
        host["train/tokens_per_s"] = tokens / max(seconds, 1e-9)
        # the model FLOPs of the tokens whose activations the step computed (shared prompts once)
        host["train/mfu"] = self.mfu(computed, length, seconds)  # may measure the peak once
        host["train/shared_prompt_frac"] = self.last_shared_fraction
        if host["train/nonfinite"] and self.cfg.nan_policy == "stop":
            raise NonFiniteError(
                f"non-finite loss or gradient at step {int(host['train/step']) + 1} "
                f"(loss/total={host['loss/total']}, train/grad_norm={host['train/grad_norm']}); "
                "the update was not applied. Set train.nan_policy='skip' to skip such updates "
                "and count them instead."
            )
        return host

    def mfu(self, tokens: int, seq_len: int, seconds: float) -> float:
        devices = list(self.mesh.devices.flat)
        if self._peak is None:
            self._peak = peak_flops(devices[0])
        # simulated CPU devices share one machine's cores: count the machine once
        n = 1 if devices[0].platform == "cpu" else len(devices)
        flops = train_flops_per_token(self.model_cfg, seq_len) * tokens
        return mfu(flops, seconds, self._peak, n)

    def replace_state(self, state: TrainState) -> None:
        self.state = state


def precompile_step(trainer: Trainer, mesh: Mesh) -> int:
    """Compile `trainer`'s update step for `mesh` ahead of time, for every batch shape it has
    been called with (`Trainer.signatures`), without any array on `mesh`: the state, batch and
    layout as `jax.ShapeDtypeStruct`s with the target shardings (`jit(...).lower(...)
    .compile()`). A `Trainer` later built on `mesh` (`move_trainer`) dispatches to those
    executables (the jitted step is shared by mesh, `jaxrl.train.step`). Safe on a background
    thread while `trainer` keeps stepping. With a correction that needs the proximal policy
    (pi_old, recomputed before the update: `decoupled`, `m2po`), that log-prob pass is compiled
    for each shape too (one update per batch; with mini-batches it compiles at its first use).
    Returns the number of executables compiled."""
    model_cfg, cfg = trainer.model_cfg, trainer.cfg
    abstract, shardings = train_state_shardings(model_cfg, cfg, mesh)
    placed = lambda a, s: jax.tree.map(
        lambda x, sh: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sh), a, s)
    state = placed(abstract, shardings)
    frozen = None
    if trainer.frozen is not None:
        frozen = placed(*frozen_shardings(model_cfg, cfg, mesh))
    step = make_train_step(trainer.graphdef, cfg, mesh, shardings)
    proximal = None
    if "proximal" in correction_needs(cfg) and trainer.updates_per_batch == 1:
        proximal = make_logprobs_fn(trainer.graphdef, chunk=cfg.logprob_chunk,
                                    replay=cfg.routing_replay)
        params = state.params if frozen is None else lora.join(frozen, state.params)
    compiled = 0
    for batch, layout, rows in trainer.signatures.copy().values():
        if rows is not None:  # padded for the new mesh's row multiple (fsdp x micro-batches)
            old = batch.shape[0]
            new = round_up(rows, cfg.micro_batches * mesh.shape["fsdp"])
            batch, layout = jax.tree.map(functools.partial(_with_rows, old=old, new=new),
                                         (batch, layout))
        batch = placed(batch, batch_shardings(batch, mesh))
        if layout is not None:
            layout = placed(layout, layout_shardings(layout, mesh))
        with jax.set_mesh(mesh):
            step.jitted(batch, frozen, layout).lower(state, batch, frozen, layout).compile()
            compiled += 1
            if proximal is not None:  # as `_prepare` calls it: neither pi_old nor ref yet
                bare = batch.replace(proximal_logprobs=None, ref_logprobs=None)
                proximal.lower(params, bare, layout).compile()
                compiled += 1
    return compiled


def _with_rows(x, *, old: int, new: int) -> jax.ShapeDtypeStruct:
    rows = (new, *x.shape[1:]) if x.shape[:1] == (old,) else x.shape
    return jax.ShapeDtypeStruct(rows, x.dtype)
