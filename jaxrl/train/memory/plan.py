"""Memory plan: the bytes every device holds for a run, known before any work (docs/memory.md).

    plan = plan_memory(cfg, model_cfg, trainer_mesh_shape=(4, 1), generator_mesh_shape=(4, 1),
                       max_seq_len=int(longest * 1.5) + 8 + cfg.data.max_new_tokens)
    print(plan.format())
    fit.check(plan)     # ConfigError with the figures and the settings that would make it fit

Exact, from abstract shapes and the one logical-axis table (`jax.eval_shape`: nothing compiled,
nothing allocated): the trainer's parameters, optimiser state (whatever `make_optimizer` holds)
and reference policy, and the generator's weights and KV cache, each per device from its sharding.
Estimated: gradients and the optimiser update's temporaries, and the activations the backward pass
keeps for the largest micro-batch (`activation_bytes`, analytic), or, when the caller passes the
compiled step, its own `memory_analysis()` (the output says which source was used).

Budget per device: an accelerator's `memory_stats()["bytes_limit"]`; on CPU every simulated device
shares the host's available RAM (/proc/meminfo MemAvailable), so the sum over devices is compared.
"""

from __future__ import annotations

import dataclasses
import functools
import math

import jax
import optax
from flax import nnx
from jax.sharding import AbstractMesh, NamedSharding, PartitionSpec

from jaxrl.config import ConfigError, ModelConfig, RunConfig, TrainConfig
from jaxrl.models import lora
from jaxrl.models.kv_cache import layer_lengths, ring_sizes
from jaxrl.models.model import abstract_model
from jaxrl.models.paged import ring_page_counts
from jaxrl.models.transformer import KVCache
from jaxrl.rounding import round_up
from jaxrl.sharding import MESH_AXES, logical_to_spec, pure_state_shardings, state_shardings
from jaxrl.train.memory.step import BYTES as _BYTES
from jaxrl.train.memory.step import fmt_bytes as _fmt
from jaxrl.train.memory.step import train_step_activations
from jaxrl.train.state import make_optimizer, model_graphdef, trainable


@dataclasses.dataclass(frozen=True)
class Item:
    role: str  # "trainer" | "generator"
    name: str
    bytes: int  # per device
    note: str = ""
    counted: bool = True  # False: shown for comparison, not in the total
    update_only: bool = False  # held only while the trainer updates (gradients, activations...)


@dataclasses.dataclass(frozen=True)
class MemoryPlan:
    items: tuple[Item, ...]
    trainer_devices: int
    generator_devices: int
    colocated: bool
    shared_host: bool  # CPU: all devices share one budget (host RAM)
    budget_bytes: int
    budget_note: str
    activation_source: str  # "analytic ..." | "compiled memory_analysis() ..."
    header: str
    cfg: RunConfig = dataclasses.field(repr=False, compare=False)
    trainer_shape: tuple[int, int] = (1, 1)
    generator_shape: tuple[int, int] = (1, 1)
    max_seq_len: int = 0
    # replan(cfg, trainer_shape, generator_shape) -> MemoryPlan, same model, budget and platform
    replan: object = dataclasses.field(default=None, repr=False, compare=False)
    # `sync`: the generator's weights and KV cache are freed while the trainer updates
    # (jaxrl.rl.loop), so on shared memory the two never add up in full
    frees_generator: bool = False

    def total(self, role: str, *, held: bool = False) -> int:
        """Bytes per device of `role` (`held`: without what only the update holds)."""
        return sum(i.bytes for i in self.items
                   if i.role == role and i.counted and not (held and i.update_only))

    def item(self, name_prefix: str) -> Item:
        return next(i for i in self.items if i.name.startswith(name_prefix))

    def need(self) -> int:
        """What is compared with the budget: the host's sum on CPU, one device's otherwise."""
        t, g = self.total("trainer"), self.total("generator")
        nt, ng = self.trainer_devices, self.generator_devices
        if not (self.shared_host or self.colocated):
            return max(t, g)
        if not self.shared_host:
            nt = ng = 1
        if self.frees_generator:  # the update, or generation next to the trainer's state
            return max(nt * t, nt * self.total("trainer", held=True) + ng * g)
        return nt * t + ng * g

    def fits(self) -> bool:
        return self.need() <= self.budget_bytes

    def format(self) -> str:
        lines = [self.header, f"{'role':<10}{'item (per device; (x): not in the total)':<52}"
                              f"{'bytes':>12}"]
        for i in self.items:
            fig = _fmt(i.bytes) if i.counted else f"({_fmt(i.bytes)})"
            lines.append(f"{i.role:<10}{i.name:<52}{fig:>12}" + (f"  {i.note}" if i.note else ""))
        for role, n in (("trainer", self.trainer_devices), ("generator", self.generator_devices)):
            lines.append(f"{role:<10}{f'total per device ({n} device(s))':<52}"
                         f"{_fmt(self.total(role)):>12}")
        what = ("sum over all devices (they share the host's RAM)" if self.shared_host else
                "per device, both roles on the same devices" if self.colocated else
                "per device, the larger role")
        if self.frees_generator and (self.shared_host or self.colocated):
            what += "; sync: the update or generation, not both"
        over = self.need() - self.budget_bytes
        verdict = "fits" if over <= 0 else f"DOES NOT FIT (over by {_fmt(over)})"
        lines.append(f"need {_fmt(self.need())} ({what}) of {_fmt(self.budget_bytes)} "
                     f"[{self.budget_note}]: {verdict}")
        lines.append(f"activations: {self.activation_source}")
        return "\n".join(lines)


def host_available_bytes() -> int:
    """MemAvailable from /proc/meminfo (what the host can give without swapping)."""
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    raise ConfigError("cannot read MemAvailable from /proc/meminfo; pass a budget")


def device_budget(devices=None) -> tuple[str, int, str]:
    """(platform, bytes, how it was found) of the first addressable device."""
    dev = next(iter(devices or jax.local_devices()))
    if dev.platform == "cpu":
        return "cpu", host_available_bytes(), "CPU: host MemAvailable shared by all devices"
    stats = dev.memory_stats() or {}
    if "bytes_limit" not in stats:
        raise ConfigError(f"{dev.device_kind}: memory_stats() has no bytes_limit; pass a budget")
    return dev.platform, int(stats["bytes_limit"]), f"{dev.device_kind} memory_stats bytes_limit"


# ------------------------------------------------------------------ exact: abstract shapes


@functools.lru_cache(maxsize=16)
def _abstract(model_cfg: ModelConfig, train_key: TrainConfig):
    """(abstract nnx state, pure params, abstract optimiser state, tx); `jax.eval_shape` only."""
    _, abstract_nnx = model_graphdef(model_cfg, train_key)
    params = nnx.to_pure_dict(abstract_nnx)
    tx = make_optimizer(train_key)  # LoRA: the optimiser holds the adapters only
    return abstract_nnx, params, jax.eval_shape(tx.init, trainable(params, model_cfg)), tx


def _shard_bytes(tree, shardings, itemsize: int | None = None) -> int:
    leaves = jax.tree.leaves(tree)
    shs = jax.tree.leaves(shardings, is_leaf=lambda s: hasattr(s, "shard_shape"))
    return sum(math.prod(s.shard_shape(x.shape)) * (itemsize or x.dtype.itemsize)
               for x, s in zip(leaves, shs, strict=True))


def _trainer_state_bytes(model_cfg: ModelConfig, train: TrainConfig, shape) -> dict:
    """Per-device bytes of params, optimiser state and an f32 copy of the trained params
    (with LoRA also the frozen base and the adapters apart: `base`, `adapters`)."""
    # the fields that change no state shape (the suggestions vary them) share one eval_shape
    key = dataclasses.replace(train, micro_batches=1, remat="none", ref_dtype=None,
                              logprob_chunk=1, param_dtype="auto", compute_dtype="auto")
    abstract_nnx, params, opt, tx = _abstract(model_cfg, key)
    mesh = AbstractMesh(tuple(shape), ("fsdp", "tp"))
    param_sh = nnx.to_pure_dict(state_shardings(abstract_nnx, mesh, "trainer"))
    (base, adapters), (base_sh, adapter_sh) = lora.split(params), lora.split(param_sh)
    trained, trained_sh = (adapters, adapter_sh) if model_cfg.lora.enabled else (params,
                                                                                 param_sh)
    rep = NamedSharding(mesh, PartitionSpec())
    opt_sh = []

    def shardings():  # traced: optax's placeholder init makes arrays, compiled when eager
        opt_sh.append(optax.tree_map_params(tx, lambda _, s: s, opt, trained_sh,
                                            transform_non_params=lambda _: rep))

    jax.eval_shape(shardings)
    opt_sh = opt_sh[0]
    count = lambda tree: sum(math.prod(x.shape) for x in jax.tree.leaves(tree))  # noqa: E731
    return {"params": _shard_bytes(params, param_sh), "opt": _shard_bytes(opt, opt_sh),
            "f32": _shard_bytes(trained, trained_sh, 4), "abstract": abstract_nnx,
            "count": count(params), "base": _shard_bytes(base, base_sh),
            "adapters": _shard_bytes(adapters, adapter_sh), "adapter_count": count(adapters)}


def _generator_bytes(abstract_nnx, gen_dtype: str, shape) -> int:
    mesh = AbstractMesh(tuple(shape), ("dp", "tp"))
    sh = pure_state_shardings(abstract_nnx, mesh, "generator")
    return _shard_bytes(nnx.to_pure_dict(abstract_nnx), sh, _BYTES[gen_dtype])


def _quantized_generator_bytes(model_cfg: ModelConfig, gen_dtype: str, shape,
                               fmt: str) -> int:
    """The 8-bit generator's weights (`generate.quantize`, format `fmt`): projections 1 byte,
    their scales f32, every other leaf in `gen_dtype`, per device on the generator mesh."""
    plain = dataclasses.replace(model_cfg, lora=type(model_cfg.lora)())
    abstract = nnx.state(abstract_model(plain, quantize=fmt))
    mesh = AbstractMesh(tuple(shape), ("dp", "tp"))
    shs = jax.tree.leaves(pure_state_shardings(abstract, mesh, "generator"),
                          is_leaf=lambda s: hasattr(s, "shard_shape"))
    leaves = jax.tree_util.tree_leaves_with_path(nnx.to_pure_dict(abstract))
    total = 0
    for (path, x), sh in zip(leaves, shs, strict=True):
        size = 1 if x.dtype.itemsize == 1 else 4 if str(path[-1].key).endswith("_scale") else None
        total += math.prod(sh.shard_shape(x.shape)) * (size or _BYTES[gen_dtype])
    return total


def _array_bytes(shape, axes, role: str, mesh_shape, itemsize: int) -> int:
    mesh = AbstractMesh(tuple(mesh_shape), MESH_AXES[role])
    spec = logical_to_spec(axes, role, mesh, shape)
    return math.prod(NamedSharding(mesh, spec).shard_shape(shape)) * itemsize


def _kv_cache_bytes(model_cfg: ModelConfig, gen, slots: int, max_len: int, gshape,
                    itemsize: int) -> tuple[int, str]:
    """The generator's KV cache per device, as the engine makes it (`KVCache.init` /
    `PagedKVCache.init` with `ring=True`: a sliding layer whose window is shorter than `max_len`
    keeps only its window, whole pages when paged), and the note naming the layers."""
    if gen.kv_layout == "paged":
        full = -(-max_len // gen.page_size)
        shapes = [(slots * (c or full), gen.page_size)
                  for c in ring_page_counts(model_cfg, max_len, gen.page_size)]
    else:
        shapes = [(slots, n) for n in layer_lengths(model_cfg, max_len)]
    tail = (model_cfg.num_kv_heads, model_cfg.head_size)
    kv = sum(2 * _array_bytes((*shape, *tail), KVCache.LOGICAL_AXES, "generator", gshape,
                              itemsize) for shape in shapes)
    rings = sum(1 for w in ring_sizes(model_cfg, max_len) if w)
    note = f"{model_cfg.num_layers} layers"
    if rings:
        note += f" ({rings} sliding: their {model_cfg.sliding_window}-position window)"
    return kv, note


# ------------------------------------------------------------------ the plan


def plan_memory(cfg: RunConfig, model_cfg: ModelConfig, *, trainer_mesh_shape,
                generator_mesh_shape, max_seq_len: int, devices=None,
                budget_bytes: int | None = None, platform: str | None = None,
                colocated: bool | None = None, compiled=None) -> MemoryPlan:
    """The plan for `cfg` on these meshes (shapes (fsdp, tp) and (dp, tp)); `max_seq_len` is the
    longest prompt + completion. `budget_bytes` overrides the device's memory; `platform`
    ("cpu" | "gpu" | "tpu", default: the devices') resolves "auto" precision and attention;
    `compiled`: the compiled train step (`step.compile_train_step`), whose
    memory_analysis() replaces the analytic step estimate. No compilation happens here."""
    note = "given budget"
    if budget_bytes is None or platform is None:
        plat, found, how = device_budget(devices)
        platform = platform or plat
        if budget_bytes is None:
            if plat != platform:
                raise ConfigError(f"planning for {platform} on a {plat} host: pass a budget "
                                  "(--budget-gib)")
            budget_bytes, note = found, how
    elif platform == "cpu":
        note = "given budget, shared by all CPU devices"
    colocated = cfg.mesh.colocated if colocated is None else colocated

    def replan(c: RunConfig, tshape=trainer_mesh_shape, gshape=generator_mesh_shape):
        return _plan(c, model_cfg, tuple(tshape), tuple(gshape), max_seq_len, platform,
                     budget_bytes, note, colocated, None, replan)

    return _plan(cfg, model_cfg, tuple(trainer_mesh_shape), tuple(generator_mesh_shape),
                 max_seq_len, platform, budget_bytes, note, colocated, compiled, replan)


def _plan(cfg, model_cfg, tshape, gshape, max_seq_len, platform, budget, note, colocated,
          compiled, replan) -> MemoryPlan:
    train, gen = cfg.train, cfg.generate
    pdt, cdt = train.precision(model_cfg.param_dtype, model_cfg.dtype, platform)
    tm = dataclasses.replace(model_cfg, param_dtype=pdt, dtype=cdt)
    st = _trainer_state_bytes(tm, train, tshape)
    fsdp, ttp = tshape
    lora_on = model_cfg.lora.enabled
    if lora_on:
        items = [Item("trainer", f"frozen base ({pdt}, "
                                 f"{(st['count'] - st['adapter_count']) / 1e6:.1f}M)", st["base"]),
                 Item("trainer", f"LoRA adapters (float32, rank {model_cfg.lora.rank}, "
                                 f"{st['adapter_count'] / 1e6:.2f}M)", st["adapters"])]
    else:
        items = [Item("trainer", f"parameters ({pdt}, {st['count'] / 1e6:.1f}M)", st["params"])]
    items.append(Item("trainer", "optimizer state" + (" (adapters only)" if lora_on else ""),
                      st["opt"], "make_optimizer's, by eval_shape"))
    if train.needs_reference and lora_on:
        items.append(Item("trainer", "reference policy (the base, zero adapters)",
                          st["adapters"]))
    elif train.needs_reference:
        rdt = train.ref_dtype or pdt
        items.append(Item("trainer", f"reference policy ({rdt})",
                          st["params"] * _BYTES[rdt] // _BYTES[pdt]))
    act, (rows, micro, length), flash, remat = train_step_activations(cfg, tm, tshape,
                                                                      max_seq_len, platform)
    trained = st["adapters"] if lora_on else st["params"]
    grads = trained + (st["f32"] if train.micro_batches > 1 else 0)
    # gradients + update take ~2.5x the f32 params in the compiled step (CPU, a 21M-parameter
    # model, 1 and 2 micro-batches; docs/memory.md): the update reuses the accumulator's buffer
    update = st["f32"] * 3 // 2 - (st["f32"] if train.micro_batches > 1 else 0)
    step = [Item("trainer", "gradients" + (" + f32 accumulator" if train.micro_batches > 1
                                           else ""), grads),
            Item("trainer", "optimizer update temporaries", update, "estimate"),
            Item("trainer", f"activations ({micro // fsdp} rows x {length} tokens, remat "
                            f"{train.remat})",
                 act, "largest micro-batch, estimate"
                 + (f"; remat {train.remat} saves nothing on XLA:CPU" if remat != train.remat
                    else ""))]
    source = "analytic estimate (activation_bytes)"
    if compiled is not None:
        ma = compiled.memory_analysis()
        step = [dataclasses.replace(i, counted=False) for i in step]
        step.append(Item("trainer", "step temporaries", int(ma.temp_size_in_bytes),
                         "compiled step's memory_analysis()"))
        source = (f"compiled memory_analysis(): temp {_fmt(ma.temp_size_in_bytes)} vs analytic "
                  f"{_fmt(act + grads + update)} (gradients + update + activations)")
    n_bt = 6 + sum(1 for x in (train.needs_reference, train.correction != "none",
                               train.mini_batches * train.epochs > 1) if x)
    batch = -(-rows // fsdp) * length * 4 * n_bt * (2 if train.mini_batches > 1 else 1)
    step.append(Item("trainer", "batch arrays", batch, f"{n_bt} x [rows, T] 4-byte"))
    items += [dataclasses.replace(i, update_only=True) for i in step]
    # generator: weights in generate.dtype (as build.generator casts them), KV cache, logits
    gdt = gen.dtype or model_cfg.param_dtype
    dp, gtp = gshape
    slots = round_up(gen.num_slots, dp)
    max_len = gen.kv_len(max_seq_len)
    kv, kv_note = _kv_cache_bytes(model_cfg, gen, slots, max_len, gshape, _BYTES[gdt])
    logits = 2 * _array_bytes((slots, model_cfg.vocab_size), ("batch", "vocab"), "generator",
                              gshape, 4)
    gen_weights = _generator_bytes(st["abstract"], gdt, gshape)
    weights_note = ""
    if lora_on and model_cfg.lora.generator == "merge":
        # the base it received once + the merged copy of the model decode runs
        gen_weights = 2 * gen_weights
        weights_note = "LoRA merge: at most the kept base + the merged weights"
    if gen.quantize != "none" and lora_on:  # the synced copy (until quantized) + 8-bit model
        gen_weights += _quantized_generator_bytes(model_cfg, gdt, gshape, gen.quantize)
        weights_note = (weights_note + "; " if weights_note else "") + (
            f"{gen.quantize}: + the {gen.quantize} model (projections 1 byte, f32 scales)")
    elif gen.quantize != "none":  # quantized before the move: only the 8-bit model arrives
        gen_weights = _quantized_generator_bytes(model_cfg, gdt, gshape, gen.quantize)
        weights_note = f"{gen.quantize}: projections 1 byte, f32 scales"
    items += [Item("generator", f"weights ({gdt})", gen_weights, weights_note),
              Item("generator", f"KV cache ({slots} slots x {max_len} positions)", kv,
                   f"x {kv_note} x (k, v) x {model_cfg.num_kv_heads} kv "
                   f"heads x {model_cfg.head_size} x {gdt}"),
              Item("generator", "decode logits + sampling", logits, "2 x [slots, V] f32")]
    header = (f"memory plan for {cfg.name} on {platform}: trainer fsdp x tp = {fsdp} x {ttp}, "
              f"generator dp x tp = {dp} x {gtp}" + (", colocated" if colocated else "")
              + f"; params {pdt}, compute {cdt}, "
              f"{'flash' if flash else 'XLA'} attention; per device")
    nt, ng = fsdp * ttp, dp * gtp
    # a LoRA merge generator keeps the base it received once: only `sync` without it frees all
    frees = cfg.pipeline.mode == "sync" and not (lora_on and model_cfg.lora.generator == "merge")
    return MemoryPlan(tuple(items), nt, ng, colocated, platform == "cpu", int(budget), note,
                      source, header, cfg, tshape, gshape, max_seq_len, replan, frees)
