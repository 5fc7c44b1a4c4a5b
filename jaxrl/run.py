"""`jaxrl.run(cfg)`: one experiment, end to end, from one Python controller.

meshes → model (HF weights or random init + cached SFT warm start) → trainer on the trainer mesh,
generator engine on the generator mesh, sandbox pool on the CPUs → the pipeline (sync / periodic /
async / inflight) → metrics, trace, checkpoints, evaluation, and a planner recommendation from the
measured rates. Ctrl-C or an error stops every thread and process it started; checkpoints already
written stay intact and `resume=True` continues from the latest.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import time
from pathlib import Path
from typing import Any

import jax
import numpy as np
from flax import nnx

from jaxrl.config import ConfigError, RunConfig, to_dict
from jaxrl.controller.buffer import apply_staleness_bound, groups_to_batch, staleness_stats
from jaxrl.controller.metrics import MetricsLogger, read_metrics
from jaxrl.controller.pipeline import Pipeline, Produced
from jaxrl.controller.rollouts import ProducerConfig, RolloutProducer
from jaxrl.controller.trace import TraceWriter
from jaxrl.controller.weight_sync import WeightSync
from jaxrl.sharding import make_meshes, pure_state_shardings

log = logging.getLogger("jaxrl")


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    history: list[dict]
    eval_start: dict
    eval_end: dict
    summary: str


def _prepare_run_dir(cfg: RunConfig, resume: bool) -> Path:
    run_dir = cfg.path
    ckpt = run_dir / "checkpoints"
    has_ckpt = ckpt.is_dir() and any(p.name.isdigit() for p in ckpt.iterdir())
    if has_ckpt and not resume:
        raise ConfigError(
            f"run directory {run_dir} already has checkpoints; pass --resume to continue it or "
            f"choose another --name"
        )
    if resume and not has_ckpt:
        raise ConfigError(f"--resume: no checkpoint under {ckpt}")
    run_dir.mkdir(parents=True, exist_ok=True)
    if not resume:
        (run_dir / "config.json").write_text(json.dumps(to_dict(cfg), indent=1, default=str))
    return run_dir


def _truncate_metrics(run_dir: Path, from_step: int) -> None:
    """On resume, drop rows logged after the checkpoint so steps continue without duplicates."""
    path = run_dir / "metrics.jsonl"
    if path.exists():
        rows = [r for r in read_metrics(run_dir) if r.get("step", 0) < from_step]
        tmp = path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in rows))
        tmp.replace(path)


def _initial_params(cfg: RunConfig, meshes, tokenizer, task, model_cfg):
    """Params on the trainer mesh: HF weights, or random init + (cached) SFT warm start."""
    from jaxrl.train.sft import warm_start
    from jaxrl.train.state import params_from_model

    if cfg.init:
        from jaxrl.models.hf import load_pretrained

        _, model = load_pretrained(cfg.init, mesh=meshes.trainer, role="trainer",
                                   dtype=model_cfg.param_dtype)
        return params_from_model(model), {}
    if jax.process_count() > 1:
        _check_sft_cached(cfg, model_cfg, tokenizer)
    params, info = warm_start(model_cfg, cfg.data, mesh=meshes.trainer, tokenizer=tokenizer,
                              task=task,
                              on_log=lambda s, m: log.info("sft step %d: %s", s, m))
    if params is None:
        from jaxrl.models import create_model

        model = create_model(model_cfg, mesh=meshes.trainer, role="trainer", seed=cfg.seed)
        return params_from_model(model), {}
    return params, {"sft/cache_hit": float(info.get("cache_hit", False)),
                    "sft/wall_s": float(info.get("wall_s", 0.0))}


def _check_sft_cached(cfg: RunConfig, model_cfg, tokenizer) -> None:
    """Several processes read the SFT warm start from its cache; they do not train it."""
    from jaxrl.train.sft import cache_key

    sft = cfg.data.sft
    if sft.steps == 0:
        return
    entry = Path(sft.cache_dir) / f"sft-{cache_key(model_cfg, cfg.data, tokenizer)}"
    if not (sft.cache and (entry / "meta.json").is_file()):
        raise ConfigError(
            f"a multi-process run loads the SFT warm start from its cache, and {entry} is "
            "missing: fill it once with one process and the same config "
            "(`python launch/run.py <same args> --pipeline.steps=0`), put data.sft.cache_dir on "
            "a filesystem every host reads, or set --data.sft.steps=0")


def _model_config(cfg: RunConfig, tokenizer):
    model_cfg = cfg.model
    if cfg.init:
        from jaxrl.models.hf import config_from_hf

        hf = json.loads((Path(cfg.init) / "config.json").read_text())
        model_cfg = config_from_hf(hf, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                                   attention_impl=cfg.model.attention_impl,
                                   remat=cfg.model.remat)
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})"
        )
    return model_cfg


class Run:
    """Owns every resource of one run; `close()` releases them (also on error / Ctrl-C)."""

    def __init__(self, cfg: RunConfig, *, resume: bool = False, progress: bool = True,
                 evaluate: bool = True):
        from jaxrl.data.pipeline import prompt_iterator
        from jaxrl.data.solve_rate import SolveRateTracker
        from jaxrl.data.tasks import build_task
        from jaxrl.distributed import is_leader, maybe_initialize, process_meshes
        from jaxrl.tokenizers import load_tokenizer

        self.cfg = cfg
        self._closers: list = []
        # Several processes: the trainer mesh spans all of them, each generates on its own
        # devices from its own prompt shard (jaxrl/distributed.py, docs/scale.md).
        self.multi = maybe_initialize(cfg.dist)
        self.leader = is_leader()
        if not self.leader:  # process 0 logs the run; the others only warnings and errors
            log.setLevel(max(log.getEffectiveLevel(), logging.WARNING))
        # fails before any work when it does not fit
        self.meshes = process_meshes(cfg.mesh) if self.multi else make_meshes(cfg.mesh)
        self.run_dir = _prepare_run_dir(cfg, resume) if self.leader else cfg.path
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.task = build_task(cfg.data)
        self.model_cfg = _model_config(cfg, self.tokenizer)
        self.trace = TraceWriter(process_name="measured")
        self.tracker = SolveRateTracker.from_config(cfg.data)
        self.prompts = prompt_iterator(self.task, _process_data(cfg.data),
                                       process_index=jax.process_index(),
                                       process_count=jax.process_count(), tracker=self.tracker)
        self.resume = resume
        self.progress = progress
        self.do_eval = evaluate

    # ---------------------------------------------------------------- components

    def _build(self):
        from jaxrl.generate.engine import JaxEngine
        from jaxrl.generate.scheduler import Scheduler
        from jaxrl.models.model import abstract_model
        from jaxrl.train.checkpoint import Checkpointer
        from jaxrl.train.trainer import Trainer

        cfg = self.cfg
        params, self.sft_metrics = None, {}  # on resume the checkpoint provides the state
        if not self.resume:
            params, self.sft_metrics = _initial_params(cfg, self.meshes, self.tokenizer,
                                                       self.task, self.model_cfg)
        max_prompt = self._max_prompt_len()
        seq_len = max_prompt + cfg.data.max_new_tokens
        self.trainer = Trainer(self.model_cfg, cfg.train, self.meshes.trainer,
                               params=params, max_len=None)
        self.ckpt = Checkpointer(self.run_dir / "checkpoints", every=cfg.train.checkpoint_every,
                                 keep=cfg.train.checkpoint_keep)
        self._closers.append(self.ckpt.close)
        self._data_state = self.prompts.get_state()
        self._tracker_state = self.tracker.get_state()
        self.ckpt.register("data", get=lambda: self._extra_state(0),
                           set=lambda v: self.prompts.set_state(self._own_state(v, "data")))
        self.ckpt.register("tracker", get=lambda: self._extra_state(1),
                           set=lambda v: self.tracker.set_state(self._own_state(v, "tracker")))
        self.start_step = 0
        if self.resume:
            state = self.ckpt.restore(self.trainer.abstract_state)
            self.trainer.replace_state(state)
            self.start_step = int(jax.device_get(state.step))
            self._data_state = self.prompts.get_state()
            self._tracker_state = self.tracker.get_state()
            if self.leader:
                _truncate_metrics(self.run_dir, self.start_step)
        self._share_states()
        # Generator: same model, optionally another dtype, on the generator mesh.
        gen_dtype = cfg.generate.dtype or self.model_cfg.param_dtype
        gen_cfg = dataclasses.replace(self.model_cfg, param_dtype=gen_dtype, dtype=gen_dtype)
        self.gen_graphdef, abstract_gen = nnx.split(abstract_model(gen_cfg))
        gen_mesh = self.meshes.generator
        targets = pure_state_shardings(abstract_gen, gen_mesh, "generator")
        from jaxrl.distributed import local_replica

        self.sync = WeightSync(targets, dtype=gen_dtype,
                               gather=local_replica if self.multi else None)
        gen_params, _ = self.sync(self.trainer.state.params)
        gen_model = nnx.merge(self.gen_graphdef, gen_params)
        max_len = cfg.generate.max_len or _bucket(seq_len)
        num_slots = cfg.generate.num_slots
        dp = gen_mesh.shape["dp"]
        num_slots = -(-num_slots // dp) * dp
        self.engine = JaxEngine(gen_model, num_slots=num_slots, max_len=max_len, mesh=gen_mesh,
                                chunk_steps=cfg.generate.chunk_steps,
                                eos_ids=(self.tokenizer.eos_id,), version=self.start_step,
                                kv_layout=cfg.generate.kv_layout,
                                page_size=cfg.generate.page_size)
        self.scheduler = Scheduler(self.engine)
        self.pool, self.scorer = self._rewards()
        self.producer = RolloutProducer(
            scheduler=self.scheduler, task=self.task, tokenizer=self.tokenizer,
            prompts=self.prompts, scorer=self.scorer, trace=self.trace, tracker=self.tracker,
            cfg=ProducerConfig(
                prompts_per_step=self.prompts.prompts_per_step, group_size=cfg.data.group_size,
                max_new_tokens=cfg.data.max_new_tokens, temperature=cfg.generate.temperature,
                top_k=cfg.generate.top_k, top_p=cfg.generate.top_p,
                filter_zero_variance=cfg.data.filter_zero_variance,
                max_oversample_rounds=cfg.pipeline.max_oversample_rounds,
                inflight=cfg.pipeline.mode == "inflight", seed=cfg.seed,
                prompt_format=cfg.data.prompt_format,
                slot_offset=jax.process_index() * self.prompts.prompts_per_step,
            ),
        )

    def _max_prompt_len(self) -> int:
        records = self.task.eval_records(min(64, self.cfg.data.eval_size))
        lengths = [len(self.task.render(r, self.tokenizer, self.cfg.data.prompt_format))
                   for r in records]
        return int(max(lengths) * 1.5) + 8

    def _rewards(self):
        from jaxrl.rewards import LocalSandboxPool, RewardScorer

        rc = self.cfg.rewards
        spec = self.task.reward_spec(timeout_s=rc.timeout_s)
        pool = None
        if spec.needs_pool:
            if rc.backend == "ray":
                from jaxrl.rewards import RaySandboxPool

                if self.multi and rc.address and not rc.num_workers:
                    raise ConfigError(
                        "rewards.backend=ray with a shared cluster (rewards.address) and several "
                        "processes: set --rewards.num_workers to each process's share of the "
                        "cluster's CPUs (each process starts its own sandbox actors)")

                pool = RaySandboxPool(address=rc.address, tier=rc.tier,
                                      num_workers=rc.num_workers or None)
            else:
                pool = LocalSandboxPool(rc.num_workers or None, tier=rc.tier)
            self._closers.append(pool.close)
            log.info("sandbox pool: %s backend, tier %s", rc.backend, getattr(pool, "tier", "?"))
        scorer = RewardScorer(spec, pool=pool, num_workers=rc.scorer_workers)
        self._closers.append(scorer.close)
        return pool, scorer

    def _share_states(self) -> None:
        """Every process's (data, tracker) state, for the checkpoint (collective)."""
        if self.multi:
            from jaxrl.distributed import allgather_objects

            self._shared_states = allgather_objects((self._data_state, self._tracker_state))

    def _extra_state(self, i: int):
        if not self.multi:
            return (self._data_state, self._tracker_state)[i]
        return {"processes": [s[i] for s in self._shared_states]}

    def _own_state(self, value, name: str):
        per_process = isinstance(value, dict) and set(value) == {"processes"}
        written_by = len(value["processes"]) if per_process else 1
        if written_by != jax.process_count():
            raise ConfigError(
                f"the checkpoint's {name} state was written by {written_by} process(es); resume "
                f"with the same number (this run has {jax.process_count()})")
        return value["processes"][jax.process_index()] if per_process else value

    # ---------------------------------------------------------------- pipeline callbacks

    def _publish(self, params, version: int):
        gen_params, stats = self.sync(params)
        gen_state = nnx.state(nnx.merge(self.gen_graphdef, gen_params))
        return gen_state, {"pipeline/weight_sync_s": stats.seconds,
                            "pipeline/weight_sync_gbps": stats.gbps,
                            "pipeline/weight_sync_bytes": float(stats.bytes)}

    def _train(self, step: int, produced: Produced):
        groups = produced.payload
        self._data_state = produced.extra["data_state"]
        self._tracker_state = produced.extra["tracker_state"] or self._tracker_state
        if self.multi:  # the global batch: every process's scored groups, in process order
            from jaxrl.distributed import allgather_objects

            parts = allgather_objects((groups, self._data_state, self._tracker_state))
            groups = [g for part in parts for g in part[0]]
            self._shared_states = [part[1:] for part in parts]
            produced.num_rollouts = sum(len(g.rollouts) for g in groups)
        pc = self.cfg.pipeline
        groups, dropped, downweighted = apply_staleness_bound(
            groups, step, max_staleness=pc.max_staleness, policy=pc.stale_policy,
            weight=pc.stale_weight,
        )
        if not groups:  # config validation rules this out; say so rather than train on nothing
            raise RuntimeError(f"step {step}: every group exceeded the staleness bound "
                               f"{pc.max_staleness} and was dropped")
        batch = groups_to_batch(groups)
        prev = self.trainer.step(batch)
        # wait for the update here, so that the trace's train_step span (and not the weight
        # sync that follows and would wait for it anyway) holds the trainer's compute
        jax.block_until_ready(self.trainer.state.params)
        metrics = dict(produced.extra["metrics"])
        metrics.update(staleness_stats(groups, step))
        metrics["staleness/dropped_groups"] = float(dropped)
        metrics["staleness/downweighted_groups"] = float(downweighted)
        metrics.update({
            "pipeline/trainer_chips": float(self.meshes.trainer.size),
            "pipeline/generator_chips": float(self.meshes.generator.size),
            "pipeline/batch_size": float(produced.num_rollouts),
            "pipeline/mode": self.cfg.pipeline.mode,
        })
        metrics["train/prev"] = prev
        return metrics, self.trainer.state.params

    def _evaluate(self, step: int, *, on_engine: bool) -> dict:
        """Held-out pass@k. Before and after the pipeline the run's own engine serves it (no
        recompilation); mid-run evaluations use a separate sampler on the trainer's params."""
        data = self.cfg.data
        records = self.task.eval_records(data.eval_size)
        if self.multi:  # each process evaluates its share of the records
            from jaxrl.distributed import allgather_objects, local_replica, shard_bounds

            start, stop = shard_bounds(len(records))
            params = None if on_engine else jax.tree.map(local_replica,
                                                         self.trainer.state.params)
            mine = (self._evaluate_records(records[start:stop], step, on_engine, start, params)
                    if stop > start else {})
            return _combine_evals(allgather_objects((stop - start, mine)))
        return self._evaluate_records(records, step, on_engine, 0, None)

    def _evaluate_records(self, records, step: int, on_engine: bool, offset: int, params):
        data = self.cfg.data
        with self.trace.span("trainer", "evaluate", step=step):
            if on_engine:
                return self.producer.evaluate(records, pass_k=data.pass_k,
                                              temperature=data.eval_temperature,
                                              seed=self.cfg.seed + step, index_offset=offset)
            from jaxrl.data.evaluate import evaluate
            from jaxrl.train.sft import sft_model

            model = sft_model(self.model_cfg, params or self.trainer.state.params)
            return evaluate(model, self.task, self.tokenizer, self.scorer, cfg=data,
                            records=records, seed=self.cfg.seed + step + offset)

    # ---------------------------------------------------------------- main loop

    def run(self) -> RunResult:
        cfg = self.cfg
        t_start = time.perf_counter()
        self._build()
        total = cfg.pipeline.steps
        logger = MetricsLogger(self.run_dir, total_steps=total, enabled=self.leader,
                               progress=self.progress)
        self._closers.append(logger.close)
        eval_start = {}
        if self.start_step == 0 and self.do_eval:
            eval_start = self._evaluate(0, on_engine=True)
            log.info("eval before RL: %s", _fmt(eval_start))
        pending: dict[str, Any] = {}

        def on_step(step: int, metrics: dict) -> None:
            from jaxrl.data.evaluate import should_evaluate

            prev = metrics.pop("train/prev")
            if prev is not None and pending:  # trainer metrics arrive one step late
                pending["row"].update(prev)
                self._log(logger, pending["step"], pending["row"])
            if self.pool is not None:
                metrics.update(self.pool.metrics())
            else:  # this task's rewards run no code: no sandbox jobs
                metrics.update({"sandbox/queue_wait_s_p50": 0.0, "sandbox/exec_s_p50": 0.0,
                                "sandbox/timeouts": 0.0})
            metrics.update(self.scorer.metrics())
            if self.multi:  # one row for the run: counters summed, the rest averaged
                from jaxrl.distributed import allgather_objects, reduce_metrics

                metrics = reduce_metrics(allgather_objects(metrics))
            pending.update(step=step, row=metrics)
            if self.ckpt.every and (step + 1) % self.ckpt.every == 0:
                self.ckpt.maybe_save(self.trainer.state)
            if self.do_eval and should_evaluate(step + 1, cfg.data) and step + 1 < total:
                metrics.update(self._evaluate(step + 1, on_engine=False))

        pipeline = Pipeline(mode=cfg.pipeline.mode, max_staleness=cfg.pipeline.max_staleness,
                            produce=self.producer.produce, train=self._train,
                            publish=self._publish, trace=self.trace)
        pipeline.run(start_step=self.start_step, num_steps=total,
                     initial_params=self.trainer.state.params, on_step=on_step)
        last = self.trainer.flush()
        if pending:
            if last is not None:
                pending["row"].update(last)
            eval_end = self._evaluate(total, on_engine=True) if self.do_eval else {}
            pending["row"].update(eval_end)
            self._log(logger, pending["step"], pending["row"])
        else:
            eval_end = {}
        self.ckpt.save(self.trainer.state)
        self.ckpt.wait()
        summary = logger.summary()
        result = RunResult(self.run_dir, total, logger.history, eval_start, eval_end, summary)
        if self.leader:
            self._report(result, time.perf_counter() - t_start)
        return result

    def _log(self, logger: MetricsLogger, step: int, row: dict) -> None:
        if self.sft_metrics and step == self.start_step:
            row.update(self.sft_metrics)
        logger.log(step, row)

    def _report(self, result: RunResult, wall_s: float) -> None:
        self.trace.save(self.run_dir / "trace.json")
        lines = [f"run {self.cfg.name}: {result.steps_done} steps in {wall_s:.0f}s "
                 f"({self.cfg.pipeline.mode} mode) -> {self.run_dir}", result.summary]
        if result.eval_start or result.eval_end:
            a = result.eval_start.get("eval/pass@1", float("nan"))
            b = result.eval_end.get("eval/pass@1", float("nan"))
            lines.append(f"held-out pass@1: {a:.3f} before RL -> {b:.3f} after")
        try:
            from jaxrl.planner.cli import format_recommendation
            from jaxrl.planner.measured import from_measured, read_run

            rec = from_measured(read_run(self.run_dir))
            lines.append("planner, from this run's measured rates "
                         f"(python launch/plan.py --from-run {self.run_dir}):\n"
                         + format_recommendation(rec))
        except Exception as e:  # noqa: BLE001 - advice only; never fail a finished run
            log.debug("planner feedback unavailable: %s", e)
        print("\n".join(lines), flush=True)

    def close(self) -> None:
        self.trace.save(self.run_dir / "trace.json") if self.leader else None
        for close in reversed(self._closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - keep closing the rest
                log.warning("error while shutting down: %s", e)
        self._closers.clear()


def _process_data(data):
    """This process's data config: `data.prompts_per_step` is per step for the whole run, so
    each of several processes draws its share (from its own shard of the prompts)."""
    n = jax.process_count()
    if n == 1:
        return data
    if data.prompts_per_step % n:
        raise ConfigError(f"data.prompts_per_step={data.prompts_per_step} must be a multiple of "
                          f"the number of processes ({n}): each process draws an equal share")
    return dataclasses.replace(data, prompts_per_step=data.prompts_per_step // n)


def _combine_evals(parts: list[tuple[int, dict]]) -> dict:
    """Every process's evaluation of its share of the records -> the metrics of all of them."""
    parts = [(n, m) for n, m in parts if n and m]
    total = sum(n for n, _ in parts)
    out: dict = {}
    for key in sorted({k for _, m in parts for k in m}):
        vals = [(n, m[key]) for n, m in parts if key in m]
        if key.endswith("/time_s"):
            out[key] = float(max(v for _, v in vals))
        elif key.endswith(("/prompts", "/reward_errors")):
            out[key] = float(sum(v for _, v in vals))
        else:
            out[key] = float(sum(n * v for n, v in vals) / max(total, 1))
    return out


def _bucket(n: int) -> int:
    size = 16
    while size < n:
        size *= 2
    return size


def _fmt(metrics: dict) -> str:
    return ", ".join(f"{k}={v:.3f}" for k, v in sorted(metrics.items())
                     if isinstance(v, float) and np.isfinite(v))


def run(cfg: RunConfig, *, resume: bool = False, progress: bool = True,
        evaluate: bool = True) -> RunResult:
    """Run one experiment; resources are released however it ends."""
    runner = Run(cfg, resume=resume, progress=progress, evaluate=evaluate)
    try:
        return runner.run()
    except BaseException as e:
        _bound_shutdown(e)
        raise
    finally:
        runner.close()


def _bound_shutdown(error: BaseException) -> None:
    """Several processes: say which one failed and why, and bound the cleanup that follows
    (closing may wait on peers that are gone)."""
    if jax.process_count() > 1:
        import sys

        from jaxrl.distributed import exit_after, failure_message

        if not isinstance(error, KeyboardInterrupt):
            print(failure_message(error), file=sys.stderr, flush=True)
        exit_after(60.0, f"{type(error).__name__}: {error}")
