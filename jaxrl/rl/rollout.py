"""The rollout verb of the RL step: prompts → completions → rewards → groups for one step.

`RolloutProducer.produce(step, scheduler, weights)` is what the loop's generator thread calls
(jaxrl/rl/loop.py), on the generator the loop holds now (a live move swaps it). It draws
`prompts_per_step` prompts, samples `group_size` completions of each on the continuous-batching
scheduler, scores them on the sandbox pool, and keeps groups whose rewards vary (DAPO dynamic
sampling): zero-variance groups are counted and, for up to `max_oversample_rounds` extra rounds,
replaced by fresh prompts. The batch always has exactly `prompts_per_step` groups (topped up with
zero-variance groups, which carry no advantage, if needed), so the train step keeps one shape.

Seeds derive from (run seed, step, round, prompt slot), so `sync` runs are bit-reproducible.
In `inflight` mode, newer published weights are installed between decode chunks.

To change how rollouts are generated or scored, edit this module; `build_rewards` builds the
sandbox pool and the scorer a run scores with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl.config import ConfigError, RunConfig
from jaxrl.cpu import return_free_memory
from jaxrl.data.evaluate import eval_metrics
from jaxrl.generate.sampling import SamplingParams
from jaxrl.generate.scheduler import Scheduler
from jaxrl.rewards import LocalSandboxPool, RewardBatch, RewardScorer
from jaxrl.rl.buffer import Group, Rollout, RolloutBuffer
from jaxrl.trace import TraceWriter

log = logging.getLogger("jaxrl")

SAMPLES_PER_STEP = 4  # (prompt, completion, reward) samples kept per batch
# A reward that fails on more than this share of a step's items (raises, returns a non-number,
# crashes its worker or passes rewards.timeout_s) stops the run with a `RewardFailure` naming the
# reward and its first error, rather than train on zeros. Up to this share, a failed item scores
# 0 and is counted (`reward/<name>/errors`, `reward/<name>/timeouts`) and the run goes on.
MAX_REWARD_FAILURE_FRAC = 0.5
Weights = Callable[[], tuple[Any, int]]  # the newest published (generator params, version)


def request_seed(run_seed: int, step: int, round_: int, slot: int) -> int:
    digest = hashlib.sha256(f"{run_seed}/{step}/{round_}/{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


class RewardFailure(ConfigError):
    """A reward failed on more than `MAX_REWARD_FAILURE_FRAC` of a step's items. A `ConfigError`
    (a broken or misconfigured reward, not a bug of the run): `launch/run.py` prints it as one
    line."""


@dataclasses.dataclass
class RewardFailures:
    """Each reward's failed items over one step's scoring rounds, and its first error."""

    items: int = 0
    failed: dict[str, int] = dataclasses.field(default_factory=dict)
    first: dict[str, str] = dataclasses.field(default_factory=dict)

    def add(self, scores: RewardBatch) -> None:
        self.items += len(scores.total)
        for name, errors in scores.errors.items():
            self.failed[name] = self.failed.get(name, 0) + errors + scores.timeouts.get(name, 0)
            if name in scores.first_errors:
                self.first.setdefault(name, scores.first_errors[name])

    def check(self, step: int) -> None:
        """Raise `RewardFailure` for the first reward past the threshold."""
        for name, failed in self.failed.items():
            if failed > MAX_REWARD_FAILURE_FRAC * self.items:
                raise RewardFailure(
                    f"reward {name!r} failed on {failed} of the {self.items} items of step "
                    f"{step} (more than MAX_REWARD_FAILURE_FRAC={MAX_REWARD_FAILURE_FRAC:g} in "
                    f"jaxrl/rl/rollout.py); first error: {self.first.get(name, '?')}. The run "
                    "stops rather than train on zero rewards: fix the reward or the fields it "
                    "reads (docs/tasks.md)")


@dataclasses.dataclass
class Produced:
    """One batch from the generator side."""

    step: int
    groups: list[Group]
    num_rollouts: int
    num_tokens: int
    busy_s: float  # generator time spent producing it (excludes waiting for weights)
    min_version: int
    metrics: dict = dataclasses.field(default_factory=dict)  # the generator side's statistics
    # a few (prompt, completion, reward) dicts of the batch, for samples.jsonl / TensorBoard text
    samples: list = dataclasses.field(default_factory=list)


@dataclasses.dataclass
class ProducerConfig:
    prompts_per_step: int
    group_size: int
    max_new_tokens: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_tokens: int = 0
    ignore_eos: bool = False
    filter_zero_variance: bool = True
    max_oversample_rounds: int = 2
    inflight: bool = False
    seed: int = 0
    prompt_format: str = "auto"
    slot_offset: int = 0  # multi-process: this process's first prompt slot in the global step


class RolloutProducer:
    def __init__(self, *, task, tokenizer, prompts, scorer, cfg: ProducerConfig,
                 trace: TraceWriter | None = None, tracker=None, data_states=None,
                 env_runner=None):
        self.task, self.tokenizer = task, tokenizer
        self.env_runner = env_runner  # multi-turn episodes (jaxrl/rl/multiturn.py) or None
        self.prompts, self.scorer, self.cfg = prompts, scorer, cfg
        self.trace = trace or TraceWriter()
        self.tracker = tracker
        self.data_states = data_states  # a `DataStates`: the state after each batch is drawn
        self._installed: tuple[Scheduler, int] | None = None  # which weights went where

    def install(self, scheduler: Scheduler, weights: Weights) -> None:
        """Put the newest published weights into `scheduler`'s engine (if not there already)."""
        params, version = weights()
        if self._installed is None or self._installed[0] is not scheduler or \
                self._installed[1] != version:
            scheduler.set_params(params, version)
            self._installed = (scheduler, version)

    def release(self, scheduler: Scheduler) -> None:
        """Free the generator's weights and KV cache until the next batch installs new ones (a
        `sync` step, while the trainer needs the memory)."""
        scheduler.release()
        self._installed = None
        return_free_memory()  # on a CPU host the update's arrays share this heap

    def _sampling(self, step: int, round_: int, slot: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            max_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
            n=c.group_size, seed=request_seed(c.seed, step, round_, c.slot_offset + slot),
            min_tokens=c.min_tokens, ignore_eos=c.ignore_eos,
        )

    def _generate(self, sched: Scheduler, records: list[dict], step: int, round_: int,
                  weights: Weights) -> list:
        ids = []
        for slot, record in enumerate(records):
            prompt = self.task.render(record, self.tokenizer, self.cfg.prompt_format)
            ids.append(sched.submit(prompt, self._sampling(step, round_, slot)))
        by_request: dict[int, list] = {rid: [] for rid in ids}
        while sched.has_work():
            for completion in sched.step():
                by_request[completion.request_id].append(completion)
            if self.cfg.inflight:
                self.install(sched, weights)
        return [sorted(by_request[rid], key=lambda c: c.sample_index) for rid in ids]

    def _score(self, records: list[dict], completions: list[list]
               ) -> tuple[list[Group], RewardBatch]:
        texts, flat_records = [], []
        for record, group in zip(records, completions, strict=True):
            for c in group:
                texts.append(self.tokenizer.decode(c.tokens, errors="replace"))
                flat_records.append(record)
        start = self.trace.now()
        scores = self.scorer.score_batch(self.task.reward_items(flat_records, texts))
        self.trace.add("sandbox", "score", start, self.trace.now() - start, items=len(texts))
        groups, k = [], 0
        for record, group in zip(records, completions, strict=True):
            rollouts = []
            for c in group:
                rollouts.append(Rollout(
                    prompt=list(c.prompt), completion=list(c.tokens), logprobs=list(c.logprobs),
                    versions=list(c.versions), finish_reason=c.finish_reason,
                    reward=scores.total[k], routing=c.routing,
                ))
                k += 1
            groups.append(Group(example=record, rollouts=rollouts))
        return groups, scores

    def _episodes(self, sched: Scheduler, records: list[dict], step: int, round_: int,
                  weights: Weights) -> tuple[list[Group], dict]:
        """Multi-turn: each prompt's `group_size` episodes, run to their end; rewards from the
        environment."""
        prompts = [self.task.render(r, self.tokenizer, self.cfg.prompt_format) for r in records]
        sampling = [self._sampling(step, round_, slot) for slot in range(len(records))]
        start = self.trace.now()
        episodes = self.env_runner.run(
            records, prompts, sampling, scheduler=sched,
            on_chunk=(lambda: self.install(sched, weights)) if self.cfg.inflight else None)
        self.trace.add("sandbox", "episodes", start, self.trace.now() - start,
                       tool_calls=self.env_runner.stats.tool_calls)
        groups = [Group(example=record, rollouts=[Rollout(
            prompt=e.prompt, completion=e.tokens, logprobs=e.logprobs, versions=e.versions,
            finish_reason=e.finish_reason, reward=e.reward, mask=e.mask) for e in eps])
            for record, eps in zip(records, episodes, strict=True)]
        metrics = self.env_runner.stats.metrics()
        if self.env_runner.sessions is not None:
            metrics.update(self.env_runner.sessions.metrics())
        return groups, metrics

    def _samples(self, groups: list[Group]) -> list[dict]:
        """The first completion of the first `SAMPLES_PER_STEP` prompts, as text."""
        out = []
        for g in groups[:SAMPLES_PER_STEP]:
            r = g.rollouts[0]
            out.append({
                "prompt": self.tokenizer.decode(r.prompt, errors="replace"),
                "completion": self.tokenizer.decode(r.completion, errors="replace"),
                "reward": float(r.reward),
            })
        return out

    def evaluate(self, sched: Scheduler, records: list[dict], *, pass_k: int,
                 temperature: float, seed: int,
                 greedy: bool = True, prefix: str = "eval", index_offset: int = 0,
                 on_sample: Callable[[int], None] | None = None) -> dict[str, float]:
        """pass@1 / pass@k (and greedy pass@1) with the engine's current weights.

        `index_offset`: position of `records[0]` among all held-out records (a process's share
        in a multi-process run samples with the same seeds as one process would).

        Runs on `sched`: call it from the generator thread while the loop runs
        (`Loop.call_on_generator`), or when it is not running. Metrics as
        `jaxrl.data.evaluate.eval_metrics` defines them. `on_sample(n)`, if given, is called as
        completions finish (n of them; `len(records) * (pass_k + greedy)` in all): progress.
        """
        start = time.perf_counter()
        prompts = [self.task.render(r, self.tokenizer, self.cfg.prompt_format) for r in records]

        errors = [0]

        def sample_rewards(n: int, temp: float) -> np.ndarray:
            if self.env_runner is not None:  # multi-turn: the episodes' rewards
                sampling = [SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=temp,
                                           n=n, seed=request_seed(seed, -1, n, index_offset + i))
                            for i in range(len(records))]
                eps = self.env_runner.run(records, prompts, sampling, scheduler=sched)
                if on_sample is not None:
                    on_sample(n * len(records))
                return np.asarray([[e.reward for e in g] for g in eps], np.float64)
            ids = [sched.submit(p, SamplingParams(
                max_tokens=self.cfg.max_new_tokens, temperature=temp, n=n,
                seed=request_seed(seed, -1, n, index_offset + i))) for i, p in enumerate(prompts)]
            done = {rid: [] for rid in ids}
            for c in sched.run():
                done[c.request_id].append(c)
                if on_sample is not None:
                    on_sample(1)
            texts = [self.tokenizer.decode(c.tokens, errors="replace")
                     for rid in ids for c in sorted(done[rid], key=lambda c: c.sample_index)]
            expanded = [r for r in records for _ in range(n)]
            scores = self.scorer.score_batch(self.task.reward_items(expanded, texts))
            errors[0] += sum(scores.errors.values())
            return np.asarray(scores.total, np.float64).reshape(len(records), n)

        rewards = sample_rewards(pass_k, temperature)
        greedy_rewards = sample_rewards(1, 0.0)[:, 0] if greedy else None
        return eval_metrics(rewards, greedy_rewards, errors=errors[0],
                            seconds=time.perf_counter() - start, prefix=prefix)

    def produce(self, step: int, sched: Scheduler, weights: Weights) -> Produced:
        start = time.perf_counter()
        self.install(sched, weights)
        sched.reset_stats()
        c = self.cfg
        buffer = RolloutBuffer(filter_zero_variance=c.filter_zero_variance)
        fallback: list[Group] = []
        reward_metrics: list[dict] = []
        failures = RewardFailures()
        all_rewards: list[float] = []
        rounds = 0
        while True:
            try:
                records = next(self.prompts)
            except StopIteration:
                raise RuntimeError(
                    f"step {step}: the training prompts ran out after {self.prompts.consumed} "
                    f"draws (data.epochs={self.prompts.epochs}; replacing zero-variance groups "
                    "draws extra prompts): raise data.epochs, or set it to 0 to repeat forever"
                ) from None
            if self.env_runner is not None:
                groups, metrics = self._episodes(sched, records, step, rounds, weights)
            else:
                completions = self._generate(sched, records, step, rounds, weights)
                groups, scores = self._score(records, completions)
                failures.add(scores)
                metrics = scores.metrics()
            reward_metrics.append(metrics)
            for g in groups:
                all_rewards.extend(g.rewards.tolist())
                if self.tracker is not None and "uid" in g.example:
                    self.tracker.update(str(g.example["uid"]), g.rewards.tolist())
                if not buffer.add(g):
                    fallback.append(g)
            rounds += 1
            if len(buffer) >= c.prompts_per_step or rounds > c.max_oversample_rounds:
                break
        failures.check(step)
        if self.data_states is not None:  # what a checkpoint after training this batch saves
            self.data_states.record(step)
        chosen = buffer.take(c.prompts_per_step)
        dropped_extra = len(buffer)
        filler = fallback[: c.prompts_per_step - len(chosen)]
        groups = chosen + filler
        gen = sched.stats
        n_rollouts = sum(len(g.rollouts) for g in groups)
        metrics = {
            "reward/mean": float(np.mean([r for g in groups for r in g.rewards])),
            "reward/produced_mean": float(np.mean(all_rewards)),
            "reward/zero_variance_group_frac": buffer.counters.zero_variance
            / max(buffer.counters.groups_added, 1),
            "reward/oversample_rounds": float(rounds - 1),
            "reward/zero_variance_filler_groups": float(len(filler)),
            "reward/oversample_dropped_groups": float(dropped_extra),
            "gen/completion_len_mean": float(
                np.mean([len(r.completion) for g in groups for r in g.rollouts])
            ),
            "gen/truncated_frac": float(
                np.mean([r.finish_reason == "length" for g in groups for r in g.rollouts])
            ),
        }
        metrics.update(gen.metrics())
        metrics.update(self.prompts.metrics())  # as of this batch (the thread runs ahead)
        for key in reward_metrics[0]:
            if key != "reward/mean":
                metrics[key] = float(np.mean([m[key] for m in reward_metrics if key in m]))
        return Produced(
            step=step, groups=groups, num_rollouts=n_rollouts,
            num_tokens=sum(g.num_tokens for g in groups), busy_s=time.perf_counter() - start,
            min_version=min(g.min_version for g in groups),
            metrics=metrics, samples=self._samples(groups),
        )


def producer_config(cfg: RunConfig, prompts_per_step: int, process_index: int) -> ProducerConfig:
    """The rollout producer's settings (this process's share of the prompts per step)."""
    data, gen = cfg.data, cfg.generate
    return ProducerConfig(
        prompts_per_step=prompts_per_step, group_size=data.group_size,
        max_new_tokens=data.max_new_tokens, temperature=gen.temperature, top_k=gen.top_k,
        top_p=gen.top_p, min_tokens=gen.min_tokens, ignore_eos=gen.ignore_eos,
        filter_zero_variance=data.filter_zero_variance,
        max_oversample_rounds=cfg.pipeline.max_oversample_rounds,
        inflight=cfg.pipeline.mode == "inflight", seed=cfg.seed,
        prompt_format=data.prompt_format, slot_offset=process_index * prompts_per_step)


def build_rewards(cfg: RunConfig, task, *, multi: bool, closers: contextlib.ExitStack):
    """(pool or None, scorer): a sandbox pool only when the task's rewards run code."""
    rc = cfg.rewards
    spec = task.reward_spec(timeout_s=rc.timeout_s)
    pool = None
    if spec.needs_pool:
        if rc.backend == "ray":
            from jaxrl.rewards import RaySandboxPool  # ray: an optional extra

            if multi and rc.address and not rc.num_workers:
                raise ConfigError(
                    "rewards.backend=ray with a shared cluster (rewards.address) and several "
                    "processes: set --rewards.num_workers to each process's share of the "
                    "cluster's CPUs (each process starts its own sandbox actors)")
            pool = RaySandboxPool(address=rc.address, tier=rc.tier,
                                  num_workers=rc.num_workers or None)
        else:
            pool = LocalSandboxPool(rc.num_workers or None, tier=rc.tier)
        closers.callback(pool.close)
        log.info("sandbox pool: %s backend, tier %s", rc.backend, getattr(pool, "tier", "?"))
    scorer = RewardScorer(spec, pool=pool, num_workers=rc.scorer_workers)
    closers.callback(scorer.close)
    return pool, scorer


def reward_metrics(pool, scorer) -> dict:
    """The sandbox and scorer columns of a metrics row."""
    if pool is not None:
        metrics = pool.metrics()
    else:  # this task's rewards run no code: no sandbox jobs
        metrics = {"sandbox/queue_wait_s_p50": 0.0, "sandbox/exec_s_p50": 0.0,
                   "sandbox/timeouts": 0.0, "sandbox/restarts": 0.0,
                   "sandbox/restart_failures": 0.0}
    metrics.update(scorer.metrics())
    return metrics


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
