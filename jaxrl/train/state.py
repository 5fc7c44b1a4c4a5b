"""`TrainState` (one pytree: params, optimiser state, step, rng) and its sharded creation.

Parameters are a pure nested dict of arrays (`nnx.to_pure_dict` of the model's state), bound to
the model with `nnx.merge(graphdef, params)` inside the jitted functions. With LoRA
(`model.lora.rank > 0`) the state's params are the adapters only; the frozen base lives beside
the state (`init_frozen`), is never donated or updated, and is joined to the adapters inside the
step (`jaxrl.models.lora.join`). The state is built
abstractly first (`jax.eval_shape`), its shardings derived from the logical-axis table
(`jaxrl.sharding.state_shardings`), then materialised directly into those shardings.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import Mesh, NamedSharding, PartitionSpec

from jaxrl.config import ModelConfig
from jaxrl.models import lora
from jaxrl.models.model import abstract_model
from jaxrl.models.transformer import Transformer
from jaxrl.sharding import state_shardings
from jaxrl.train.config import TrainConfig


@jax.tree_util.register_dataclass
@dataclasses.dataclass(frozen=True)
class TrainState:
    params: dict  # pure nested dict of arrays, the model's nnx.Param state
    opt_state: optax.OptState
    step: jax.Array  # int32 [], number of updates applied
    rng: jax.Array  # uint32 [2], raw key data (derive with fold_in(key, step))
    nonfinite_skips: jax.Array  # int32 [], updates skipped for NaN/Inf (nan_policy="skip")

    def replace(self, **kw) -> TrainState:
        return dataclasses.replace(self, **kw)


def learning_rate_schedule(cfg: TrainConfig) -> optax.Schedule:
    """Linear warmup from 0 over `warmup_steps`, then constant or cosine to lr * min_lr_ratio."""
    if cfg.schedule == "constant":
        after = optax.constant_schedule(cfg.lr)
    else:
        decay = max(cfg.total_steps - cfg.warmup_steps, 1)
        after = optax.cosine_decay_schedule(cfg.lr, decay, alpha=cfg.min_lr_ratio)
    if not cfg.warmup_steps:
        return after
    warm = optax.linear_schedule(0.0, cfg.lr, cfg.warmup_steps)
    return optax.join_schedules([warm, after], [cfg.warmup_steps])


def make_optimizer(cfg: TrainConfig) -> optax.GradientTransformation:
    """Global-norm clipping then AdamW; no weight decay on vectors (norm scales, biases)."""
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)
    adamw = optax.adamw(
        learning_rate_schedule(cfg),
        b1=cfg.b1,
        b2=cfg.b2,
        eps=cfg.adam_eps,
        weight_decay=cfg.weight_decay,
        mask=decay_mask,
    )
    if cfg.max_grad_norm > 0:
        return optax.chain(optax.clip_by_global_norm(cfg.max_grad_norm), adamw)
    return adamw


def model_graphdef(model_cfg: ModelConfig, train_cfg: TrainConfig):
    """The model's graphdef (static structure) and abstract pure-dict params.

    remat="full" turns on the model's per-layer rematerialisation; the policy variants
    ("dots", "dots_no_batch") are applied around the forward pass by the step."""
    model_cfg = dataclasses.replace(model_cfg, remat=train_cfg.remat == "full")
    graphdef, abstract = nnx.split(abstract_model(model_cfg))
    return graphdef, abstract


def trainable(params: dict, model_cfg: ModelConfig) -> dict:
    """The part of a full params dict that trains: the adapters with LoRA, else all of it."""
    return lora.split(params)[1] if model_cfg.lora.enabled else params


def frozen_shardings(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh):
    """(abstract frozen base, its NamedShardings) of a LoRA model; (None, None) without LoRA."""
    if not model_cfg.lora.enabled:
        return None, None
    _, abstract_nnx = model_graphdef(model_cfg, train_cfg)
    shardings = lora.split(nnx.to_pure_dict(state_shardings(abstract_nnx, mesh, "trainer")))[0]
    abstract = lora.split(nnx.to_pure_dict(abstract_nnx))[0]
    return abstract, shardings


def train_state_shardings(
    model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh
) -> tuple[TrainState, TrainState]:
    """(abstract TrainState, TrainState of NamedShardings) for this mesh; nothing allocated."""
    _, abstract_nnx = model_graphdef(model_cfg, train_cfg)
    param_sh = trainable(nnx.to_pure_dict(state_shardings(abstract_nnx, mesh, "trainer")),
                         model_cfg)
    abstract_params = trainable(nnx.to_pure_dict(abstract_nnx), model_cfg)
    tx = make_optimizer(train_cfg)
    abstract_opt = jax.eval_shape(tx.init, abstract_params)
    rep = NamedSharding(mesh, PartitionSpec())
    opt_sh = optax.tree_map_params(
        tx, lambda _, s: s, abstract_opt, param_sh, transform_non_params=lambda _: rep
    )
    abstract = TrainState(
        params=abstract_params,
        opt_state=abstract_opt,
        step=jax.ShapeDtypeStruct((), jnp.int32),
        rng=jax.ShapeDtypeStruct((2,), jnp.uint32),
        nonfinite_skips=jax.ShapeDtypeStruct((), jnp.int32),
    )
    shardings = TrainState(
        params=param_sh, opt_state=opt_sh, step=rep, rng=rep, nonfinite_skips=rep
    )
    abstract = jax.tree.map(
        lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract, shardings
    )
    return abstract, shardings


# (model_cfg, train_cfg, mesh, from_params) -> jitted init, so re-created trainers reuse it.
_INIT: dict = {}


def init_train_state(
    model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh, *, params: dict | None = None
) -> TrainState:
    """A fresh TrainState, materialised directly in its trainer-mesh shardings.

    `params`: start from these (e.g. loaded weights, any sharding); else a random init with seed
    `train_cfg.seed`. With LoRA, `params` may hold the base only (fresh adapters are drawn) or
    the base and adapters (e.g. a loaded PEFT adapter); the state gets the adapters."""
    if model_cfg.lora.enabled and params is not None:
        adapters = lora.split(params)[1]
        params = adapters or None
    _, shardings = train_state_shardings(model_cfg, train_cfg, mesh)
    # the state's structure depends only on these (the optimiser's values live in the step)
    key = (
        model_cfg,
        train_cfg.remat,
        train_cfg.seed,
        train_cfg.max_grad_norm > 0,
        mesh,
        params is not None,
    )
    if key not in _INIT:
        tx = make_optimizer(train_cfg)
        graph_cfg = dataclasses.replace(model_cfg, remat=train_cfg.remat == "full")

        def init(p):
            if p is None:
                model = Transformer(graph_cfg, rngs=nnx.Rngs(train_cfg.seed))
                p = trainable(nnx.to_pure_dict(nnx.state(model)), model_cfg)
            key_data = jax.random.key_data(jax.random.key(train_cfg.seed, impl="threefry2x32"))
            zero = jnp.zeros((), jnp.int32)
            return TrainState(
                params=p, opt_state=tx.init(p), step=zero, rng=key_data, nonfinite_skips=zero
            )

        if params is None:
            _INIT[key] = jax.jit(lambda: init(None), out_shardings=shardings)
        else:
            _INIT[key] = jax.jit(init, out_shardings=shardings)
    if params is None:
        return _INIT[key]()
    abstract = trainable(nnx.to_pure_dict(model_graphdef(model_cfg, train_cfg)[1]), model_cfg)
    params = jax.tree.map(  # e.g. f32 master weights from bf16 checkpoint weights
        lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), params, abstract)
    return _INIT[key](jax.device_put(params, shardings.params))


def init_frozen(model_cfg: ModelConfig, train_cfg: TrainConfig, mesh: Mesh, *,
                params: dict | None = None) -> dict | None:
    """The frozen base of a LoRA model on the trainer mesh, in the trainer's param dtype:
    from `params` (adapters in it are ignored), else the seeded random init (the same weights
    `init_train_state` draws). None without LoRA."""
    abstract, shardings = frozen_shardings(model_cfg, train_cfg, mesh)
    if abstract is None:
        return None
    if params is None:
        graph_cfg = dataclasses.replace(model_cfg, remat=train_cfg.remat == "full")
        init = lambda: lora.split(nnx.to_pure_dict(nnx.state(
            Transformer(graph_cfg, rngs=nnx.Rngs(train_cfg.seed)))))[0]
        return jax.jit(init, out_shardings=shardings)()
    base = lora.split(params)[0]
    base = jax.tree.map(lambda x, a: x if x.dtype == a.dtype else x.astype(a.dtype), base,
                        abstract)
    # a copy that shares no buffer with `params` (whose owner may donate or drop them)
    copy = jax.jit(lambda p: jax.tree.map(lambda x: x + 0, p), out_shardings=shardings)
    return copy(jax.device_put(base, shardings))


def params_from_model(model) -> dict:
    """Pure-dict params of an NNX model (shares its arrays)."""
    return nnx.to_pure_dict(nnx.state(model))
