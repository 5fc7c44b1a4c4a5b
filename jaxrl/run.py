"""`jaxrl.run(cfg)`: one experiment, end to end. The composition root, read top to bottom: it
builds the parts and hands them to the loop (jaxrl/rl/loop.py; docs/architecture.md).

  1. processes, meshes;  2. tokenizer, task, model config, memory plan, prompts, then the run
  directory (written only once these checks passed);  3. the trainer (HF weights, or random init
  + cached SFT warm start, or the latest checkpoint with `resume=True`);  4. the generator
  (weights resharded from the trainer), rewards, rollout producer, evaluator;  5. the loop:
  rollout → update → weight sync per step, with its hooks, checkpoints and live moves;  6. the
  summary, held-out pass@1 before -> after, the planner's advice.

Ctrl-C or an error stops every thread and process the run started; checkpoints already written
stay intact. SIGTERM or Ctrl-C during the steps first checkpoints the last finished step.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import time
from pathlib import Path

from jaxrl.config import RunConfig
from jaxrl.config.checks import check_model_lengths, sequence_capacity
from jaxrl.data.pipeline import prompt_iterator
from jaxrl.data.solve_rate import SolveRateTracker
from jaxrl.data.tasks import build_task, longest_prompt
from jaxrl.rl import metrics, rollout
from jaxrl.rl.data_state import DataStates
from jaxrl.rl.evaluator import Evaluator
from jaxrl.rl.hooks import eval_hook, open_checkpoints
from jaxrl.rl.loop import Loop, Parts
from jaxrl.rl.multiturn import build_runner
from jaxrl.rl.processes import Processes
from jaxrl.rl.rebalance import build_rebalance
from jaxrl.rl.stopping import Stopping
from jaxrl.rl.sync import build_generator
from jaxrl.rl.update import Update
from jaxrl.tokenizers import load_tokenizer
from jaxrl.trace import TraceWriter
from jaxrl.train import init
from jaxrl.train.checkpoint import naming_config_differences
from jaxrl.train.memory.fit import check_run as check_memory

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
    with contextlib.ExitStack() as closers:  # closed in reverse, whatever happens
        closers.callback(stopping.install())  # undone last: a second signal exits at once
        try:
            return _run(cfg, processes, closers, stopping, resume=resume, progress=progress,
                        do_eval=evaluate)
        except BaseException as e:
            processes.on_failure(e)
            raise


def _run(cfg: RunConfig, processes: Processes, closers: contextlib.ExitStack, stopping: Stopping,
         *, resume: bool, progress: bool, do_eval: bool) -> RunResult:
    t_start = time.perf_counter()
    # 1. processes, meshes
    meshes = processes.meshes(cfg.mesh)
    # 2. tokenizer, task, model config, prompts; then the run directory (a failed check writes none)
    tokenizer = load_tokenizer(cfg.tokenizer, init=cfg.init)  # "auto": the model's own
    task = build_task(cfg.data)
    model_cfg = init.model_config(cfg, tokenizer)
    longest = longest_prompt(cfg, task, tokenizer)
    check_model_lengths(cfg, model_cfg, longest)
    seq_len = sequence_capacity(longest, cfg.data.max_new_tokens)
    check_memory(cfg, model_cfg, meshes, seq_len, leader=processes.leader)
    tracker = SolveRateTracker.from_config(cfg.data)
    prompts = prompt_iterator(task, processes.data_config(cfg.data),
                              process_index=processes.index, process_count=processes.count,
                              tracker=tracker)
    rollout.check_data_lasts(cfg, prompts, cfg.pipeline.steps)  # before any work
    data_states = DataStates(prompts, tracker, processes)
    recorded = init.recorded_config(cfg, model_cfg)  # config.json: the model trained
    run_dir = metrics.prepare_run_dir(recorded, resume, leader=processes.leader)
    trace = TraceWriter(process_name="measured")
    if processes.leader:
        closers.callback(lambda: trace.save(run_dir / "trace.json"))
    # 3. the trainer (its state from HF / SFT, or from the latest checkpoint)
    trainer, sft_metrics = init.build_trainer(cfg, meshes.trainer, tokenizer, task, model_cfg,
                                              processes, resume=resume)
    with naming_config_differences(recorded, run_dir):  # not "restore the files"
        checkpoints, start_step = open_checkpoints(cfg, run_dir, trainer, data_states,
                                                   processes, closers, resume=resume)
    # 4. generator, rewards, producer, evaluator
    generator = build_generator(cfg, model_cfg, meshes.generator, trainer.state.params,
                                seq_len=seq_len, version=start_step, eos_id=tokenizer.eos_ids,
                                multi=processes.multi, base=trainer.frozen)
    pool, scorer = rollout.build_rewards(cfg, task, multi=processes.multi, closers=closers)
    producer = rollout.RolloutProducer(
        task=task, tokenizer=tokenizer, prompts=prompts, scorer=scorer, trace=trace,
        tracker=tracker, data_states=data_states,
        env_runner=build_runner(cfg, task, tokenizer, scorer, closers, trace),  # multi-turn
        cfg=rollout.producer_config(cfg, prompts.prompts_per_step, processes.index))
    evaluator = Evaluator(producer, task, cfg.data, processes, seed=cfg.seed, progress=progress)
    # 5. the loop, its hooks and checkpoints
    logger = metrics.MetricsLogger(run_dir, total_steps=cfg.pipeline.steps,
                                   enabled=processes.leader, progress=progress,
                                   samples_every=cfg.pipeline.samples_every)
    closers.callback(logger.close)
    logger.log_config(dataclasses.asdict(recorded))
    evals = do_eval and cfg.data.eval  # run(evaluate=False) or --data.eval=false: none at all
    hooks = [eval_hook(evaluator, every=cfg.data.eval_every, start_done=start_step == 0)]
    update = Update(cfg.pipeline, processes, data_states)
    loop = Loop(
        Parts(trainer, generator, meshes.trainer.size, meshes.generator.size),
        mode=cfg.pipeline.mode, max_staleness=cfg.pipeline.max_staleness, rollouts=producer,
        update=update, lead=update.lead if cfg.pipeline.lead == "auto" else None,
        hooks=hooks if evals else [], log_row=logger.log_step, checkpoints=checkpoints,
        reduce=processes.reduce_metrics, row_metrics=lambda: rollout.reward_metrics(pool, scorer),
        rebalance=build_rebalance(cfg, model_cfg, meshes, seq_len, tokenizer, closers), trace=trace)
    del trainer, generator  # the loop holds them (a live move replaces them)
    eval_start = {}
    if evals and start_step == 0:
        eval_start = evaluator(0, on_generator=loop.call_on_generator)
        log.info("eval before RL: %s", metrics.fmt_metrics(eval_start))
    # a signal stops the steps at a safe point with a checkpoint (jaxrl/rl/stopping.py)
    save = lambda n: (checkpoints.save(n, loop.parts.trainer), checkpoints.ckpt.wait())  # noqa
    with stopping.deferred(save=save):
        loop.run(start_step=start_step, num_steps=cfg.pipeline.steps,
                 first_row={**sft_metrics, **eval_start}, should_stop=stopping.requested)
    checkpoints.ckpt.wait()
    # 6. the end
    last = logger.history[-1] if logger.history else {}
    eval_end = {k: v for k, v in last.items() if k.startswith("eval/")} if evals else {}
    result = RunResult(run_dir, cfg.pipeline.steps, logger.history, eval_start, eval_end,
                       logger.summary())
    if processes.leader:
        trace.save(run_dir / "trace.json")
        metrics.report(cfg, result, time.perf_counter() - t_start,
                       metrics.planner_report(run_dir))
    return result
