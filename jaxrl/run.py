"""`jaxrl.run(cfg)`: one experiment, end to end, from one Python controller. Read top to bottom:

  1. processes, meshes (a mesh that does not fit fails here, before any work);
  2. tokenizer, task, model config, memory plan (printed; a run that does not fit stops), prompts
     (checked to last), then the run directory (written only once all these checks passed);
  3. the trainer on the trainer mesh: HF weights, or random init + cached SFT warm start, or the
     latest checkpoint with `resume=True`;
  4. the generator on the generator mesh (weights resharded from the trainer), the reward side
     (sandbox pool + scorer), the rollout producer and the evaluator;
  5. the learner (the trainer side of a step) with its hooks: metrics rows, checkpoints,
     evaluation; then the pipeline (sync / periodic / async / inflight) runs the steps;
  6. the end: the last row, held-out evaluation, a final checkpoint, the planner's advice.

Ctrl-C or an error stops every thread and process the run started; checkpoints already written
stay intact and `resume=True` continues from the latest (docs/architecture.md: one step's flow).
SIGTERM or Ctrl-C during the steps first checkpoints the last finished step (docs/survival.md).
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path

from jaxrl.config import RunConfig
from jaxrl.config.checks import check_model_lengths, sequence_capacity
from jaxrl.controller import build
from jaxrl.controller.processes import Processes
from jaxrl.controller.stopping import Stopping

log = logging.getLogger("jaxrl")


@dataclasses.dataclass
class RunResult:
    run_dir: Path
    steps_done: int
    history: list[dict]
    eval_start: dict
    eval_end: dict
    summary: str


def run(cfg: RunConfig, *, resume: bool = False, progress: bool = True,
        evaluate: bool = True) -> RunResult:
    """Run one experiment; every resource it started is released however it ends."""
    processes = Processes(cfg)
    stopping = Stopping(cfg.preemption_grace_s, processes)  # SIGTERM / SIGINT
    closers: list = [stopping.install()]  # undone last: a second signal exits at once
    try:
        return _run(cfg, processes, closers, stopping, resume=resume, progress=progress,
                    do_eval=evaluate)
    except BaseException as e:
        processes.on_failure(e)
        raise
    finally:
        for close in reversed(closers):
            try:
                close()
            except Exception as e:  # noqa: BLE001 - keep closing the rest
                log.warning("error while shutting down: %s", e)


def _run(cfg: RunConfig, processes: Processes, closers: list, stopping: Stopping, *,
         resume: bool, progress: bool, do_eval: bool) -> RunResult:
    from jaxrl.controller.data_state import DataStates
    from jaxrl.controller.evaluator import Evaluator
    from jaxrl.controller.learner import Learner
    from jaxrl.controller.metrics import MetricsLogger
    from jaxrl.controller.multiturn import build_runner
    from jaxrl.controller.pipeline import Pipeline
    from jaxrl.controller.rollouts import RolloutProducer
    from jaxrl.trace import TraceWriter
    from jaxrl.data.pipeline import prompt_iterator
    from jaxrl.data.solve_rate import SolveRateTracker
    from jaxrl.data.tasks import build_task
    from jaxrl.tokenizers import load_tokenizer
    from jaxrl.train.checkpoint import Checkpointer
    from jaxrl.train.trainer import Trainer, tree_bytes

    t_start = time.perf_counter()
    # 1. processes, meshes
    meshes = processes.meshes(cfg.mesh)
    # 2. tokenizer, task, model config, prompts; then the run directory (a failed check writes none)
    tokenizer = load_tokenizer(cfg.tokenizer, init=cfg.init)  # "auto": the model's own
    task = build_task(cfg.data)
    model_cfg = build.model_config(cfg, tokenizer)
    longest = build.longest_prompt(cfg, task, tokenizer)
    check_model_lengths(cfg, model_cfg, longest)
    seq_len = sequence_capacity(longest, cfg.data.max_new_tokens)
    build.memory_plan(cfg, model_cfg, meshes, seq_len, leader=processes.leader)
    tracker = SolveRateTracker.from_config(cfg.data)
    prompts = prompt_iterator(task, processes.data_config(cfg.data),
                              process_index=processes.index, process_count=processes.count,
                              tracker=tracker)
    build.check_data_lasts(cfg, prompts, cfg.pipeline.steps)  # before any work
    data_states = DataStates(prompts, tracker, processes)
    run_dir = build.prepare_run_dir(cfg, resume, leader=processes.leader)
    trace = TraceWriter(process_name="measured")
    if processes.leader:
        closers.append(lambda: trace.save(run_dir / "trace.json"))
    # 3. the trainer (its state from HF / SFT, or from the latest checkpoint)
    params, sft_metrics = None, {}
    if not resume or model_cfg.lora.enabled:  # a LoRA checkpoint holds the adapters only
        params, sft_metrics = build.initial_params(cfg, meshes.trainer, tokenizer, task, model_cfg,
                                                   processes)
        sft_metrics = {} if resume else sft_metrics
    ref = build.reference_params(cfg, meshes.trainer, tokenizer, task, model_cfg, processes, params)
    trainer = Trainer(model_cfg, cfg.train, meshes.trainer, params=params, ref_params=ref)
    params = ref = None  # the trainer copied them: not a model's worth held for the whole run
    if trainer.ref_params is not None:
        log.info("reference policy: %.1f MiB on the trainer mesh",
                 tree_bytes(trainer.ref_params) / 2**20)
    ckpt = Checkpointer(run_dir / "checkpoints", every=cfg.train.checkpoint_every,
                        keep=cfg.train.checkpoint_keep)
    closers.append(ckpt.close)
    data_states.register(ckpt)
    build.register_lora_base(ckpt, trainer, cfg)
    start_step = 0
    if resume:  # checkpoints are numbered by pipeline steps done
        start_step, state = ckpt.restore_newest(trainer.abstract_state)  # skips damaged ones
        trainer.replace_state(state)
        if processes.leader:
            build.truncate_metrics(run_dir, start_step)
    data_states.reset()
    ckpt.check_space(trainer.state)  # room for two checkpoints, before any step
    # 4. generator, rewards, producer, evaluator
    publisher, _, scheduler = build.generator(
        cfg, model_cfg, meshes.generator, trainer.state.params,
        seq_len=seq_len, version=start_step,
        eos_id=tokenizer.eos_id, multi=processes.multi, base=trainer.frozen)
    pool, scorer = build.rewards(cfg, task, multi=processes.multi, closers=closers)
    env_runner = build_runner(cfg, task, scheduler, tokenizer, scorer, closers,  # multi-turn
                              trace)
    producer = RolloutProducer(
        scheduler=scheduler, task=task, tokenizer=tokenizer, prompts=prompts, scorer=scorer,
        trace=trace, tracker=tracker, data_states=data_states, env_runner=env_runner,
        cfg=build.producer_config(cfg, prompts.prompts_per_step, processes.index))
    evaluator = Evaluator(producer, task, cfg.data, processes, seed=cfg.seed, trace=trace)
    # 5. the learner and its hooks, then the pipeline
    total = cfg.pipeline.steps
    logger = MetricsLogger(run_dir, total_steps=total, enabled=processes.leader,
                           progress=progress)
    closers.append(logger.close)

    def log_row(step: int, row: dict) -> None:
        if step == start_step:  # SFT metrics; at step 0 also the before-RL evaluation
            row.update({**sft_metrics, **evals["start"]})
        logger.log(step, row)

    learner = Learner(
        trainer=trainer, sync=publisher, pipeline_cfg=cfg.pipeline, processes=processes,
        data_states=data_states, row_metrics=lambda: build.reward_metrics(pool, scorer),
        constants={"pipeline/trainer_chips": float(meshes.trainer.size),
                   "pipeline/generator_chips": float(meshes.generator.size),
                   "pipeline/mode": cfg.pipeline.mode})
    del trainer, publisher, scheduler  # live moves replace them (in learner, producer)
    pipeline = Pipeline(mode=cfg.pipeline.mode, max_staleness=cfg.pipeline.max_staleness,
                        produce=producer.produce, train=learner.train,
                        publish=learner.publish, release=producer.release, trace=trace,
                        lead=learner.lead if cfg.pipeline.lead == "auto" else None)
    evals, advice = {"start": {}, "end": {}}, []

    def save_checkpoint(steps_done: int, row: dict) -> None:  # registered last: completes the row
        ckpt.wait()  # the previous checkpoint is complete before later rows are written
        learner.complete_row()
        data_states.share()
        ckpt.save(learner.trainer.state, step=steps_done)  # a live move replaces the trainer

    def evaluate_mid_run(steps_done: int, row: dict) -> None:
        if steps_done < total and (steps_done > 1 or not evals["start"]):  # row 0 has it
            row.update(evaluator(steps_done, pipeline=pipeline))

    def evaluate_end(steps_done: int, row: dict) -> None:
        evals["end"] = evaluator(total, pipeline=pipeline)  # installs the final weights
        row.update(evals["end"])

    def planner_feedback(step: int, row: dict) -> None:
        if processes.leader:
            advice.append(build.planner_report(run_dir))

    learner.add_hook(log_row, every=1, at_end=True, on="row")
    learner.add_hook(lambda s, _: logger.log_samples(s, producer.samples.pop(s, []),
                                                     every=cfg.pipeline.samples_every), on="row")
    logger.log_config(dataclasses.asdict(cfg))
    evaluator.progress = progress
    learner.add_hook(planner_feedback, every=0, on="row")
    if do_eval and cfg.data.eval:  # run(evaluate=False) or --data.eval=false: none at all
        if cfg.data.eval_every:
            learner.add_hook(evaluate_mid_run, every=cfg.data.eval_every)
        learner.add_hook(evaluate_end, every=0)
        if start_step == 0:
            evals["start"] = evaluator(0)
            log.info("eval before RL: %s", build.fmt_metrics(evals["start"]))
    build.live_rebalance(cfg, model_cfg, meshes, learner, pipeline, producer, seq_len, tokenizer)
    learner.add_hook(save_checkpoint, every=cfg.train.checkpoint_every, at_end=True)
    # a signal stops the steps at a safe point with a checkpoint (jaxrl/controller/stopping.py)
    with stopping.deferred(save=lambda n: (save_checkpoint(n, {}), ckpt.wait())):
        pipeline.run(start_step=start_step, num_steps=total, on_step=learner.on_step,
                     initial_params=learner.trainer.state.params, should_stop=stopping.requested)
    # 6. the end
    learner.finish(total)
    ckpt.wait()
    result = RunResult(run_dir, total, logger.history, evals["start"], evals["end"],
                       logger.summary())
    if processes.leader:
        trace.save(run_dir / "trace.json")
        build.report(cfg, result, time.perf_counter() - t_start, advice[-1] if advice else None)
    return result
