"""The pieces `jaxrl.run` builds, one function each: run directory, model config, initial
parameters, generator (engine + scheduler + weight publisher) and the reward side."""

from __future__ import annotations

import dataclasses
import json
import logging
from pathlib import Path

import numpy as np

from jaxrl.config import ConfigError, RunConfig, to_dict
from jaxrl.controller.metrics import read_metrics, set_aside_logs
from jaxrl.rounding import round_up

log = logging.getLogger("jaxrl")


def prepare_run_dir(cfg: RunConfig, resume: bool, *, leader: bool) -> Path:
    """The run directory: new (config.json written), or one with checkpoints for `--resume`. A
    directory without a committed checkpoint is started afresh, its old logs moved aside."""
    run_dir = cfg.path
    if not leader:
        return run_dir
    ckpt = run_dir / "checkpoints"
    has_ckpt = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
    if has_ckpt and not resume:
        raise ConfigError(
            f"run directory {run_dir} already has checkpoints; pass --resume to continue it or "
            f"choose another --name")
    if resume and not has_ckpt:
        raise ConfigError(f"--resume: no checkpoint under {ckpt}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        aside = set_aside_logs(run_dir)  # an earlier attempt stopped before its first checkpoint
        if aside is not None:
            log.warning("%s had logs but no checkpoint: moved them to %s; starting fresh",
                        run_dir, aside)
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1, default=str))
    return run_dir


def truncate_metrics(run_dir: Path, from_step: int) -> None:
    """On resume, drop rows logged after the checkpoint so steps continue without duplicates."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [r for r in read_metrics(run_dir) if r.get("step", 0) < from_step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)


def model_config(cfg: RunConfig, tokenizer):
    """`cfg.model`, or the Hugging Face model's own config when `cfg.init` names one (a local
    directory or a Hub id, `jaxrl.models.hub.resolve`)."""
    model_cfg = cfg.model
    if cfg.init:
        from jaxrl.models.hf import config_from_hf
        from jaxrl.models.hub import resolve
        from jaxrl.models.safetensors_io import CheckpointError

        hf = json.loads((resolve(cfg.init, what="init") / "config.json").read_text())
        try:
            model_cfg = config_from_hf(
                hf, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                attention_impl=cfg.model.attention_impl, remat=cfg.model.remat,
                lora=cfg.model.lora)
        except CheckpointError as e:  # an architecture or setting jaxrl does not implement
            raise ConfigError(f"init={cfg.init!r}: {e}") from None
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})")
    return model_cfg


def longest_prompt(cfg: RunConfig, task, tokenizer) -> int:
    """Tokens in the longest of (up to) 64 held-out prompts. The KV cache is sized for prompts
    of 1.5x that + 8 (`generate.max_len=0`)."""
    records = task.eval_records(min(64, cfg.data.eval_size))
    return max(len(task.render(r, tokenizer, cfg.data.prompt_format)) for r in records)


def memory_plan(cfg: RunConfig, model_cfg, meshes, seq_len: int, *, leader: bool) -> None:
    """Print the bytes per device the run will need before any work, and stop it
    (`mesh.memory_check="fail"`) or warn ("warn") when they exceed the device's memory."""
    if cfg.mesh.memory_check == "off":
        return
    from jaxrl.generate.disaggregated import decode_mesh_shape
    from jaxrl.train.memory_plan import plan_memory

    budget = int(cfg.mesh.memory_budget_gib * 2**30) or None
    # prefill/decode split: the decode group holds the KV cache on fewer devices
    gen_shape = decode_mesh_shape(meshes.generator.devices.shape, cfg.generate.prefill_devices)
    plan = plan_memory(cfg, model_cfg, trainer_mesh_shape=meshes.trainer.devices.shape,
                       generator_mesh_shape=gen_shape,
                       colocated=meshes.colocated, max_seq_len=seq_len, budget_bytes=budget)
    if leader:
        log.info("memory plan:\n%s", plan.format())
    if cfg.mesh.memory_check == "fail":
        plan.check()
    elif not plan.fits():
        log.warning("the memory plan says the run does not fit (mesh.memory_check='warn': "
                    "going on); the figures above")


def check_data_lasts(cfg: RunConfig, prompts, steps: int) -> None:
    """Fail before any work when `steps` more batches would exhaust the prompts (data.epochs
    passes over this process's shard), with the numbers and the settings that fix it."""
    left = prompts.batches_left()
    if left is None or left >= steps:
        if left is not None and left < steps * (1 + cfg.pipeline.max_oversample_rounds):
            log.warning(
                "the prompts last %d steps; replacing zero-variance groups "
                "(pipeline.max_oversample_rounds=%d) draws more and may exhaust them: consider "
                "--data.epochs=0 (repeat)", left, cfg.pipeline.max_oversample_rounds)
        return
    per_epoch = prompts.shard_size // prompts.prompts_per_step
    need = -(-steps * prompts.prompts_per_step // prompts.shard_size)
    raise ConfigError(
        f"the data runs out: {prompts.shard_size} training prompts"
        f"{' per process' if cfg.dist.num_processes else ''} at data.prompts_per_step="
        f"{cfg.data.prompts_per_step} make {per_epoch} steps per epoch, and data.epochs="
        f"{cfg.data.epochs} leaves {left} of the {steps} steps to run (pipeline.steps="
        f"{cfg.pipeline.steps}); set --data.epochs={need} or more, --data.epochs=0 (repeat "
        f"forever), or --pipeline.steps<={left}")


def initial_params(cfg: RunConfig, mesh, tokenizer, task, model_cfg, processes):
    """Params on the trainer mesh and their metrics: HF weights, or random init plus the cached
    SFT warm start."""
    from jaxrl.train.sft import warm_start
    from jaxrl.train.state import params_from_model

    # LoRA: this is the base (the trainer draws or loads the adapters)
    model_cfg = dataclasses.replace(model_cfg, lora=type(model_cfg.lora)())
    if cfg.init:
        from jaxrl.models.hf import load_pretrained
        from jaxrl.models.hub import resolve

        _, model = load_pretrained(resolve(cfg.init, what="init"), mesh=mesh, role="trainer",
                                   dtype=model_cfg.param_dtype)
        return params_from_model(model), {}
    processes.check_sft_cached(cfg, model_cfg, tokenizer)
    # SFT shows its own progress display (jaxrl.progress): no second line per step
    params, info = warm_start(model_cfg, cfg.data, mesh=mesh, tokenizer=tokenizer, task=task)
    if params is None:
        from jaxrl.models import create_model

        model = create_model(model_cfg, mesh=mesh, role="trainer", seed=cfg.seed)
        return params_from_model(model), {}
    return params, {"sft/cache_hit": float(info.get("cache_hit", False)),
                    "sft/wall_s": float(info.get("wall_s", 0.0))}


def reference_params(cfg: RunConfig, mesh, tokenizer, task, model_cfg, processes, initial):
    """The frozen reference policy for the KL term (None when not needed): `train.ref_init`'s
    HF weights, else the run's initial policy. On resume it is rebuilt the way the initial
    policy was (HF weights, the cached SFT warm start, or the seeded random init)."""
    if not cfg.train.needs_reference or model_cfg.lora.enabled:  # LoRA: the base is the ref
        return None
    if cfg.train.ref_init:
        from jaxrl.models.hf import load_pretrained
        from jaxrl.models.hub import resolve
        from jaxrl.train.state import params_from_model

        _, model = load_pretrained(resolve(cfg.train.ref_init, what="train.ref_init"),
                                   mesh=mesh, role="trainer",
                                   dtype=model_cfg.param_dtype)
        return params_from_model(model)
    if initial is None:
        initial, _ = initial_params(cfg, mesh, tokenizer, task, model_cfg, processes)
    return initial


def base_fingerprint(base: dict) -> str:
    """A digest of a LoRA run's frozen base: the first 64 values of every leaf, as bytes (the
    same on any mesh shape; cheap to read off the devices)."""
    import hashlib

    import jax

    digest = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(base)[0],
                             key=lambda kv: jax.tree_util.keystr(kv[0])):
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.asarray(jax.device_get(leaf.reshape(-1)[:64])).tobytes())
    return digest.hexdigest()[:16]


def register_lora_base(ckpt, trainer, cfg: RunConfig) -> None:
    """A LoRA checkpoint holds the adapters and their optimiser state; it records which base
    they belong to (`init`, or the seeded init / SFT warm start, and a digest of the weights),
    and `--resume` refuses a base that differs (e.g. a changed `--init` directory)."""
    if trainer.frozen is None:
        return
    info = {"init": cfg.init or f"seeded init (seed {cfg.train.seed}) + SFT warm start",
            "fingerprint": base_fingerprint(trainer.frozen)}

    def check(saved: dict) -> None:
        if saved and saved.get("fingerprint") != info["fingerprint"]:
            raise ConfigError(
                f"the LoRA checkpoint's adapters were trained on another base: saved "
                f"{saved.get('init')!r} (fingerprint {saved.get('fingerprint')}), now "
                f"{info['init']!r} (fingerprint {info['fingerprint']}); resume with the same "
                "--init (or model and seed) the run started with")

    ckpt.register("lora_base", get=lambda: info, set=check)


def generator(cfg: RunConfig, model_cfg, mesh, trainer_params, *, seq_len: int, version: int,
              eos_id: int, multi: bool, base=None):
    """(publisher, engine, scheduler): the generator's copy of the model on its own mesh, in
    `generate.dtype`, filled from the trainer's params by resharding. A LoRA run passes its
    frozen `base` (moved once) and adapters as `trainer_params` (moved every publish)."""
    from flax import nnx

    from jaxrl.controller.weight_sync import GeneratorPublisher, WeightSync
    from jaxrl.distributed import local_replica
    from jaxrl.generate.engine import JaxEngine
    from jaxrl.generate.scheduler import Scheduler
    from jaxrl.models.model import abstract_model
    from jaxrl.sharding import pure_state_shardings

    devices_total, prefill_mesh = mesh.size, None
    if cfg.generate.prefill_devices:  # weights published to the decode group, copied to prefill
        from jaxrl.generate.disaggregated import split_generator_mesh

        try:
            prefill_mesh, mesh = split_generator_mesh(mesh, cfg.generate.prefill_devices)
        except ValueError as e:
            raise ConfigError(str(e)) from None
    gen_dtype = cfg.generate.dtype or model_cfg.param_dtype
    gen_cfg = dataclasses.replace(model_cfg, param_dtype=gen_dtype, dtype=gen_dtype)
    gather = local_replica if multi else None
    quant = None if cfg.generate.quantize == "none" else cfg.generate.quantize
    if model_cfg.lora.enabled:
        publisher, graphdef = lora_publisher(gen_cfg, mesh, base, gather, quantize=quant)
        gen_params = publisher.publish(trainer_params, version)[0]
    elif quant:  # cast, fused and quantized on the trainer's devices; the 8-bit copy moves
        from jaxrl.models.quant import generator_state_fn

        fuse = cfg.generate.fuse_projections
        graphdef, abstract = nnx.split(abstract_model(gen_cfg, quantize=quant, fused=fuse))
        sync = WeightSync(pure_state_shardings(abstract, mesh, "generator"), gather=gather)
        quantize = generator_state_fn(nnx.graphdef(abstract_model(gen_cfg)), quantize=quant,
                                      fuse=fuse, dtype=gen_dtype)
        publisher = GeneratorPublisher(sync, graphdef, quantize, before_move=True)
        gen_params = publisher.publish(trainer_params, version)[0]
    else:
        graphdef, abstract = nnx.split(abstract_model(gen_cfg))
        targets = pure_state_shardings(abstract, mesh, "generator")
        sync = WeightSync(targets, dtype=gen_dtype, gather=gather)
        quantize, fuse = None, cfg.generate.fuse_projections
        if fuse:  # moved in generate.dtype, then fused on the generator mesh
            quantize = generator_transform(gen_cfg, mesh, graphdef, fuse=fuse)
            graphdef = nnx.graphdef(abstract_model(gen_cfg, fused=fuse))
        publisher = GeneratorPublisher(sync, graphdef, quantize)
        gen_params = publisher.publish(trainer_params, version)[0]
    kind, split = JaxEngine, {}
    if prefill_mesh is not None:
        from jaxrl.generate.disaggregated import DisaggregatedEngine

        kind, split = DisaggregatedEngine, dict(prefill_mesh=prefill_mesh)
    engine = kind(nnx.merge(graphdef, gen_params),
                  num_slots=round_up(cfg.generate.num_slots, mesh.shape["dp"]),
                  max_len=cfg.generate.kv_len(seq_len),
                  mesh=mesh, chunk_steps=cfg.generate.chunk_steps, eos_ids=(eos_id,),
                  version=version, kv_layout=cfg.generate.kv_layout,
                  page_size=cfg.generate.page_size,
                  debug_delay_s=cfg.generate.debug_chunk_delay_s / devices_total, **split)
    return publisher, engine, Scheduler(engine)


def live_rebalance(cfg: RunConfig, model_cfg, meshes, learner, pipeline, producer,
                   seq_len: int, tokenizer):
    """With `pipeline.rebalance=auto` or `rebalance_every`, adds the `LiveRebalance` step hook
    to the learner (registered before the checkpoint hook, which completes the row), over the
    devices of both meshes; returns it (None when off). A move rebuilds the generator (engine,
    scheduler, publisher) on its new mesh from the moved trainer's params, hands the scheduler
    to the producer (and its multi-turn runner) and the publisher to the learner. A split is
    feasible when the tp sizes divide it and the memory plan says it fits."""
    from jaxrl.controller.rebalance import LiveRebalance
    from jaxrl.train.memory_plan import plan_memory

    if cfg.pipeline.rebalance == "off" and not cfg.pipeline.rebalance_every:
        return None

    def rebuild_generator(mesh, params, version: int):
        publisher, engine, scheduler = generator(
            cfg, model_cfg, mesh, params, seq_len=seq_len, version=version, eos_id=tokenizer.eos_id,
            multi=False, base=learner.trainer.frozen)
        producer.scheduler, producer.version = scheduler, version
        if producer.env_runner is not None:
            producer.env_runner.scheduler = scheduler
        learner.sync = publisher
        return engine.params.state

    def fits(trainer_shape, generator_shape) -> bool:
        if cfg.mesh.memory_check == "off":
            return True
        budget = int(cfg.mesh.memory_budget_gib * 2**30) or None
        return plan_memory(cfg, model_cfg, trainer_mesh_shape=trainer_shape,
                           generator_mesh_shape=generator_shape, colocated=False,
                           max_seq_len=seq_len, budget_bytes=budget).fits()

    devices = [*meshes.trainer.devices.flat, *meshes.generator.devices.flat]
    live = LiveRebalance(cfg.pipeline, devices, meshes.trainer.size,
                         trainer_tp=meshes.trainer.shape["tp"],
                         generator_tp=meshes.generator.shape["tp"], learner=learner,
                         pipeline=pipeline, rebuild_generator=rebuild_generator, fits=fits,
                         batch=cfg.data.prompts_per_step * cfg.data.group_size)
    learner.add_hook(live)
    return live


def generator_transform(gen_cfg, mesh, plain_graphdef, *, quantize: str | None = None,
                        fuse: bool = False):
    """The jitted `params -> params` of the generator's own copy, on the generator mesh:
    `plain_graphdef`'s model (no adapters) with its projections fused
    (`generate.fuse_projections`) and/or quantized to the format `quantize`
    (`generate.quantize`: "int8", "w8a8", "fp8"; None: not quantized), laid out as the
    transformed model's shardings (`jaxrl.models.quant.generator_state_fn`)."""
    from flax import nnx

    from jaxrl.models.model import abstract_model
    from jaxrl.models.quant import generator_state_fn
    from jaxrl.sharding import pure_state_shardings

    plain_cfg = dataclasses.replace(gen_cfg, lora=type(gen_cfg.lora)())
    abstract = nnx.state(abstract_model(plain_cfg, quantize=quantize, fused=fuse))
    return generator_state_fn(plain_graphdef, pure_state_shardings(abstract, mesh, "generator"),
                              quantize=quantize, fuse=fuse)


def lora_publisher(gen_cfg, mesh, base, gather, *, quantize: str | None = None):
    """(LoraPublisher, the generator model's graphdef) for a LoRA run: the base moved once in
    the generator's dtype; adapters every publish, then merged into a plain model on the
    generator mesh (`model.lora.generator="merge"`) or applied in its forward pass.
    `quantize` (a `generate.quantize` format, None: off): the merged weights (or, in the forward
    pass, the base once) quantized to it."""
    from flax import nnx

    from jaxrl.controller.weight_sync import LoraPublisher, WeightSync
    from jaxrl.models import lora
    from jaxrl.models.model import abstract_model
    from jaxrl.sharding import pure_state_shardings

    lora_cfg = gen_cfg.lora
    merge = lora_cfg.generator == "merge"
    _, abstract = nnx.split(abstract_model(gen_cfg))
    base_targets, adapter_targets = lora.split(pure_state_shardings(abstract, mesh, "generator"))
    plain_cfg = dataclasses.replace(gen_cfg, lora=type(lora_cfg)())
    graphdef = nnx.graphdef(abstract_model(plain_cfg if merge else gen_cfg, quantize=quantize))
    if quantize is not None:
        quantize = generator_transform(gen_cfg, mesh, nnx.graphdef(abstract_model(plain_cfg)),
                                       quantize=quantize)
    # adapters stay f32 to be merged (the sum is rounded once); cast when applied per token
    adapter_sync = WeightSync(adapter_targets, dtype=None if merge else gen_cfg.dtype,
                              gather=gather)
    base_sync = WeightSync(base_targets, dtype=gen_cfg.param_dtype, gather=gather)
    publisher = LoraPublisher(base_sync, adapter_sync, graphdef, base, lora_cfg, merge=merge,
                              merged_shardings=base_targets, quantize=quantize)
    return publisher, graphdef


def producer_config(cfg: RunConfig, prompts_per_step: int, process_index: int):
    """The rollout producer's settings (this process's share of the prompts per step)."""
    from jaxrl.controller.rollouts import ProducerConfig

    data, gen = cfg.data, cfg.generate
    return ProducerConfig(
        prompts_per_step=prompts_per_step, group_size=data.group_size,
        max_new_tokens=data.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
        top_p=gen.top_p, min_tokens=gen.min_tokens, ignore_eos=gen.ignore_eos,
        filter_zero_variance=data.filter_zero_variance,
        max_oversample_rounds=cfg.pipeline.max_oversample_rounds,
        inflight=cfg.pipeline.mode == "inflight", seed=cfg.seed,
        prompt_format=data.prompt_format, slot_offset=process_index * prompts_per_step)


def rewards(cfg: RunConfig, task, *, multi: bool, closers: list):
    """(pool or None, scorer): a sandbox pool only when the task's rewards run code."""
    from jaxrl.rewards import LocalSandboxPool, RewardScorer

    rc = cfg.rewards
    spec = task.reward_spec(timeout_s=rc.timeout_s)
    pool = None
    if spec.needs_pool:
        if rc.backend == "ray":
            from jaxrl.rewards import RaySandboxPool

            if multi and rc.address and not rc.num_workers:
                raise ConfigError(
                    "rewards.backend=ray with a shared cluster (rewards.address) and several "
                    "processes: set --rewards.num_workers to each process's share of the "
                    "cluster's CPUs (each process starts its own sandbox actors)")
            pool = RaySandboxPool(address=rc.address, tier=rc.tier,
                                  num_workers=rc.num_workers or None)
        else:
            pool = LocalSandboxPool(rc.num_workers or None, tier=rc.tier)
        closers.append(pool.close)
        log.info("sandbox pool: %s backend, tier %s", rc.backend, getattr(pool, "tier", "?"))
    scorer = RewardScorer(spec, pool=pool, num_workers=rc.scorer_workers)
    closers.append(scorer.close)
    return pool, scorer


def reward_metrics(pool, scorer) -> dict:
    """The sandbox and scorer columns of a metrics row."""
    if pool is not None:
        metrics = pool.metrics()
    else:  # this task's rewards run no code: no sandbox jobs
        metrics = {"sandbox/queue_wait_s_p50": 0.0, "sandbox/exec_s_p50": 0.0,
                   "sandbox/timeouts": 0.0}
    metrics.update(scorer.metrics())
    return metrics


def planner_report(run_dir: Path) -> str | None:
    """The planner's recommended split from this run's measured rates (advice; never fails)."""
    try:
        from jaxrl.planner.cli import format_recommendation
        from jaxrl.planner.measured import from_measured, read_run

        rec = from_measured(read_run(run_dir))
        return ("planner, from this run's measured rates "
                f"(python launch/plan.py --from-run {run_dir}):\n" + format_recommendation(rec))
    except Exception as e:  # noqa: BLE001 - advice only; never fail a finished run
        log.debug("planner feedback unavailable: %s", e)
        return None


def report(cfg: RunConfig, result, wall_s: float, advice: str | None) -> None:
    """The run's last lines: steps and wall-clock, the summary, pass@1 before -> after, advice."""
    lines = [f"run {cfg.name}: {result.steps_done} steps in {wall_s:.0f}s "
             f"({cfg.pipeline.mode} mode) -> {result.run_dir}", result.summary]
    if result.eval_start or result.eval_end:
        a = result.eval_start.get("eval/pass@1", float("nan"))
        b = result.eval_end.get("eval/pass@1", float("nan"))
        lines.append(f"held-out pass@1: {a:.3f} before RL -> {b:.3f} after")
    if advice:
        lines.append(advice)
    print("\n".join(lines), flush=True)


def fmt_metrics(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items())
                     if isinstance(v, float) and np.isfinite(v))
