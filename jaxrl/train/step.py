"""The pure training step, jitted once per batch layout with explicit trainer-mesh shardings.

`train_step(state, batch) -> (state, metrics)`:
  1. batch-global targets (advantages, M2PO mask, normalisers) on the full batch;
  2. forward + backward per micro-batch (`lax.scan`, gradients summed in f32): micro-batch m is
     rows m, m + M, m + 2M, ... so every micro-batch stays spread over the fsdp axis;
  3. global grad norm, NaN/Inf check, optax update. A non-finite loss or gradient never reaches
     the parameters: the update is skipped and `train/nonfinite` = 1 is reported (the host stops
     the run on it unless nan_policy="skip", which counts it in `state.nonfinite_skips`).
The state is donated: the caller must not reuse the state it passed in.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.models import lora
from jaxrl.models.transformer import rope_tables
from jaxrl.sharding import logical_sharding
from jaxrl.train.batch import Batch
from jaxrl.train.config import TrainConfig
from jaxrl.train.logprobs import model_logprobs_routed, shared_logprobs
from jaxrl.train.objective import OBJECTIVES, Targets, check_batch_for, combine_stats
from jaxrl.train.prefix import PrefixLayout, micro_layouts
from jaxrl.train.state import TrainState, learning_rate_schedule, make_optimizer


def _micro_loss(params, mb: Batch, tg: Targets, rope=None, layout: PrefixLayout | None = None,
                *, graphdef, cfg: TrainConfig, objective: str = "policy", frozen=None):
    model = nnx.merge(graphdef, params if frozen is None else lora.join(frozen, params))
    kw = dict(chunk=cfg.logprob_chunk, remat=cfg.remat, keep_probs_mb=cfg.lm_head_keep_mb,
              entropy_grad=cfg.entropy_coef > 0)
    if layout is not None:  # shared prompts (`jaxrl.train.prefix`); dense models only
        logp_BT, ent_BT = shared_logprobs(model, mb, layout, **kw)
        routing_stats = {}
    else:
        logp_BT, ent_BT, routing_stats = model_logprobs_routed(
            model, mb, rope=rope, replay=cfg.routing_replay, **kw)
    loss, stats = OBJECTIVES[objective][1](cfg, logp_BT, ent_BT, mb, tg)
    return loss, {**stats, **routing_stats}


def _split_micro(x, m: int):
    """[B, ...] -> [M, B/M, ...] with micro-batch i = rows i, i+M, ... (keeps fsdp spread)."""
    return x.reshape(x.shape[0] // m, m, *x.shape[1:]).swapaxes(0, 1)


def _grads_and_stats(params, batch: Batch, tg: Targets, layout: PrefixLayout | None = None, *,
                     graphdef, cfg: TrainConfig, objective: str = "policy", frozen=None):
    """Gradients with respect to `params` only (a LoRA base in `frozen` gets none); `layout`:
    the batch's shared prompts (`jaxrl.train.prefix`), prefix arrays per micro-batch."""
    grad_fn = jax.value_and_grad(
        functools.partial(_micro_loss, graphdef=graphdef, cfg=cfg, objective=objective,
                          frozen=frozen),
        has_aux=True,
    )
    m = cfg.micro_batches
    if m == 1:
        one = None if layout is None else jax.tree.map(lambda x: x[0], micro_layouts(layout, 1))
        (_, stats), grads = grad_fn(params, batch, tg, None, one)
        return grads, stats
    per_row = dataclasses.replace(tg, num_tokens=None, num_seqs=None)
    # rotary tables for the whole batch, outside the loop (see `Transformer.hidden`)
    full = params if frozen is None else lora.join(frozen, params)
    rope = rope_tables(nnx.merge(graphdef, full).cfg, batch.positions)
    mbs = jax.tree.map(lambda x: _split_micro(x, m), (batch, per_row, rope))
    mbs = (*mbs, None if layout is None else micro_layouts(layout, m))
    tok_M = jnp.sum(mbs[1].mask_BT > 0, axis=(1, 2)).astype(jnp.float32)
    frac_M = tok_M / jnp.maximum(tg.num_tokens, 1.0)

    def body(carry, xs):
        g_acc, s_acc = carry
        mb, mtg, mrope, mlayout, frac = xs
        mtg = dataclasses.replace(mtg, num_tokens=tg.num_tokens, num_seqs=tg.num_seqs)
        (_, stats), g = grad_fn(params, mb, mtg, mrope, mlayout)
        g_acc = jax.tree.map(lambda a, b: a + b.astype(jnp.float32), g_acc, g)
        return (g_acc, combine_stats(s_acc, stats, frac)), None

    mb0 = jax.tree.map(lambda x: x[0], mbs)
    stats_shape = jax.eval_shape(
        lambda: grad_fn(
            params,
            mb0[0],
            dataclasses.replace(mb0[1], num_tokens=tg.num_tokens, num_seqs=tg.num_seqs),
            mb0[2],
            mb0[3],
        )[0][1]
    )
    s0 = jax.tree.map(lambda s: jnp.zeros(s.shape, s.dtype), stats_shape)
    g0 = jax.tree.map(lambda p: jnp.zeros(p.shape, jnp.float32), params)
    (grads, stats), _ = jax.lax.scan(body, (g0, s0), (*mbs, frac_M))
    return grads, stats


def train_step(state: TrainState, batch: Batch, frozen=None, layout: PrefixLayout | None = None,
               *, graphdef, cfg: TrainConfig, tx, objective: str = "policy"):
    """One optimiser update from one batch (pure; see the module docstring). `objective` names
    the loss (`objective.OBJECTIVES`): the RL policy objective, or "sft" for the warm start.
    `frozen`: a LoRA model's base params (`state.params` are then its adapters). `layout`: the
    batch's shared prompts (`jaxrl.train.prefix.plan_prefix_layout`), or None."""
    if objective == "policy":
        check_batch_for(cfg, batch)
    tg, stats = OBJECTIVES[objective][0](cfg, batch)
    grads, mstats = _grads_and_stats(state.params, batch, tg, layout, graphdef=graphdef, cfg=cfg,
                                     objective=objective, frozen=frozen)
    stats.update(mstats)
    grads = jax.tree.map(lambda g, p: g.astype(p.dtype), grads, state.params)
    grad_norm = optax.global_norm(grads)
    finite = jnp.isfinite(stats["loss/total"]) & jnp.isfinite(grad_norm)
    updates, new_opt = tx.update(grads, state.opt_state, state.params)
    new_params = optax.apply_updates(state.params, updates)
    keep = lambda new, old: jax.tree.map(lambda n, o: jnp.where(finite, n, o), new, old)
    new_state = TrainState(
        params=keep(new_params, state.params),
        opt_state=keep(new_opt, state.opt_state),
        step=state.step + finite.astype(jnp.int32),
        rng=state.rng,
        nonfinite_skips=state.nonfinite_skips + (~finite).astype(jnp.int32),
    )
    stats["train/grad_norm"] = grad_norm
    stats["train/lr"] = learning_rate_schedule(cfg)(state.step)
    stats["train/nonfinite"] = (~finite).astype(jnp.int32)
    stats["train/step"] = new_state.step
    return new_state, stats


def batch_shardings(batch: Batch, mesh: Mesh) -> Batch:
    """NamedShardings for a batch: rows over the trainer's batch axis (fsdp), tokens whole."""

    def one(x):
        if x is None:
            return None
        axes = ("batch", "length", *(None,) * (x.ndim - 2))[: x.ndim]
        return logical_sharding(mesh, "trainer", axes, x.shape)

    return jax.tree.map(one, batch)


def layout_shardings(layout: PrefixLayout, mesh: Mesh) -> PrefixLayout:
    """NamedShardings for a shared-prompt layout: per-row arrays as the batch's rows, the
    prefixes replicated (every row may read any prefix of its micro-batch)."""
    rep = NamedSharding(mesh, PartitionSpec())

    def rows(x):
        axes = ("batch", "length")[: x.ndim]
        return logical_sharding(mesh, "trainer", axes, x.shape)

    return PrefixLayout(rep, rep, rep, rows(layout.group_B), rows(layout.suffix_index_BS),
                        rows(layout.inverse_BT))


def trace_key(cfg: TrainConfig) -> TrainConfig:
    """`cfg` with the fields the step's computation does not depend on reset (cache key)."""
    return dataclasses.replace(
        cfg, nan_policy="stop", checkpoint_every=0, checkpoint_keep=1, seed=0
    )


# (graphdef, trace_key(cfg), mesh, optimizer, objective, layout) -> jitted step; re-created
# Trainers reuse it. The optimizer part is "cfg" for `make_optimizer(cfg)` (its settings are in
# the key already) and the transformation itself for any other.
_JITTED: dict = {}


def make_train_step(graphdef, cfg: TrainConfig, mesh: Mesh, state_shardings: TrainState,
                    tx=None, *, objective: str = "policy"):
    """`step(state, batch, frozen=None) -> (state, metrics)`, jitted with explicit shardings,
    state donated (`frozen`, a LoRA model's base, is not).

    One jitted function per batch layout (which optional fields are present); each compiles once
    per padded shape, so pad batches to a few shapes (`batch.padded_shape`). `tx` defaults to
    `make_optimizer(cfg)`; `objective` is "policy" (RL) or "sft"."""
    if objective not in OBJECTIVES:
        raise ValueError(f"objective {objective!r} is not valid; choose one of {list(OBJECTIVES)}")
    tx_key = "cfg" if tx is None else tx
    tx = make_optimizer(cfg) if tx is None else tx
    rep = NamedSharding(mesh, PartitionSpec())
    pure = functools.partial(train_step, graphdef=graphdef, cfg=cfg, tx=tx, objective=objective)

    def jitted(batch: Batch, frozen=None, prefix: PrefixLayout | None = None):
        """The jitted step for this layout of arguments (arrays or `jax.ShapeDtypeStruct`s
        with shardings: `jitted(...).lower(state, batch, frozen, prefix).compile()` compiles
        it ahead, and later calls with such arguments reuse that executable)."""
        fields = tuple(f.name for f in dataclasses.fields(batch) if getattr(batch, f.name) is None)
        key = (graphdef, trace_key(cfg), mesh, tx_key, objective, fields, frozen is None,
               prefix is None)
        if key not in _JITTED:
            frozen_sh = None if frozen is None else jax.tree.map(lambda x: x.sharding, frozen)
            prefix_sh = None if prefix is None else layout_shardings(prefix, mesh)
            _JITTED[key] = jax.jit(
                pure,
                in_shardings=(state_shardings, batch_shardings(batch, mesh), frozen_sh, prefix_sh),
                out_shardings=(state_shardings, rep),
                donate_argnums=0,
            )
        return _JITTED[key]

    def step(state: TrainState, batch: Batch, frozen=None, prefix: PrefixLayout | None = None):
        """`frozen`: a LoRA model's base (placed on its shardings; never donated); `prefix`:
        the batch's shared prompts (`jaxrl.train.prefix`), or None."""
        fn = jitted(batch, frozen, prefix)
        with jax.set_mesh(mesh):  # the mesh in context: Pallas attention runs per shard on it
            return fn(state, batch, frozen, prefix)

    step.jitted = jitted
    return step
