"""The generator side of a run: prompts → completions → rewards → groups for one step.

`RolloutProducer.produce(step, weights)` is what the pipeline's generator thread calls. It draws
`prompts_per_step` prompts, samples `group_size` completions of each on the continuous-batching
scheduler, scores them on the sandbox pool, and keeps groups whose rewards vary (DAPO dynamic
sampling): zero-variance groups are counted and, for up to `max_oversample_rounds` extra rounds,
replaced by fresh prompts. The batch always has exactly `prompts_per_step` groups (topped up with
zero-variance groups, which carry no advantage, if needed), so the train step keeps one shape.

Seeds derive from (run seed, step, round, prompt slot), so `sync` runs are bit-reproducible.
In `inflight` mode, newer published weights are installed between decode chunks.
"""

from __future__ import annotations

import dataclasses
import hashlib
import time
from collections.abc import Callable
from typing import Any

import numpy as np

from jaxrl.controller.buffer import Group, Rollout, RolloutBuffer
from jaxrl.controller.pipeline import Produced
from jaxrl.trace import TraceWriter
from jaxrl.cpu import return_free_memory
from jaxrl.generate.sampling import SamplingParams
from jaxrl.generate.scheduler import Scheduler

SAMPLES_PER_STEP = 4  # (prompt, completion, reward) samples kept per batch
KEEP_SAMPLES_STEPS = 64  # batches whose samples the producer holds for the run's hook


def request_seed(run_seed: int, step: int, round_: int, slot: int) -> int:
    digest = hashlib.sha256(f"{run_seed}/{step}/{round_}/{slot}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


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
    def __init__(self, *, scheduler: Scheduler, task, tokenizer, prompts, scorer,
                 cfg: ProducerConfig, trace: TraceWriter | None = None, tracker=None,
                 data_states=None, env_runner=None):
        self.scheduler, self.task, self.tokenizer = scheduler, task, tokenizer
        self.env_runner = env_runner  # multi-turn episodes (controller/multiturn.py) or None
        self.prompts, self.scorer, self.cfg = prompts, scorer, cfg
        self.trace = trace or TraceWriter()
        self.tracker = tracker
        self.data_states = data_states  # a `DataStates`: the state after each batch is drawn
        self.version = None
        # step -> Produced.samples of the last few batches, for the run's samples hook (the
        # learner hands rows, not batches, to hooks)
        self.samples: dict[int, list[dict]] = {}

    def _install(self, weights: Callable[[], tuple[Any, int]]) -> None:
        params, version = weights()
        if version != self.version:
            self.scheduler.set_params(params, version)
            self.version = version

    def release(self) -> None:
        """Free the generator's weights and KV cache until the next batch installs new ones
        (`Pipeline(release=...)`: a `sync` step, while the trainer needs the memory)."""
        self.scheduler.release()
        self.version = None
        return_free_memory()  # on a CPU host the update's arrays share this heap

    def _sampling(self, step: int, round_: int, slot: int) -> SamplingParams:
        c = self.cfg
        return SamplingParams(
            max_tokens=c.max_new_tokens, temperature=c.temperature, top_k=c.top_k, top_p=c.top_p,
            n=c.group_size, seed=request_seed(c.seed, step, round_, c.slot_offset + slot),
            min_tokens=c.min_tokens, ignore_eos=c.ignore_eos,
        )

    def _generate(self, records: list[dict], step: int, round_: int, weights) -> list:
        ids = []
        for slot, record in enumerate(records):
            prompt = self.task.render(record, self.tokenizer, self.cfg.prompt_format)
            ids.append(self.scheduler.submit(prompt, self._sampling(step, round_, slot)))
        by_request: dict[int, list] = {rid: [] for rid in ids}
        while self.scheduler.has_work():
            for completion in self.scheduler.step():
                by_request[completion.request_id].append(completion)
            if self.cfg.inflight:
                self._install(weights)
        return [sorted(by_request[rid], key=lambda c: c.sample_index) for rid in ids]

    def _score(self, records: list[dict], completions: list[list]) -> tuple[list[Group], dict]:
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
        return groups, scores.metrics()

    def _episodes(self, records: list[dict], step: int, round_: int, weights
                  ) -> tuple[list[Group], dict]:
        """Multi-turn: each prompt's `group_size` episodes, run to their end; rewards from the
        environment."""
        prompts = [self.task.render(r, self.tokenizer, self.cfg.prompt_format) for r in records]
        sampling = [self._sampling(step, round_, slot) for slot in range(len(records))]
        start = self.trace.now()
        episodes = self.env_runner.run(
            records, prompts, sampling,
            on_chunk=(lambda: self._install(weights)) if self.cfg.inflight else None)
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

    def install(self, weights: Callable[[], tuple[Any, int]]) -> None:
        """Put the newest published weights into the engine (if not there already)."""
        self._install(weights)

    def evaluate(self, records: list[dict], *, pass_k: int, temperature: float, seed: int,
                 greedy: bool = True, prefix: str = "eval", index_offset: int = 0,
                 on_sample: Callable[[int], None] | None = None) -> dict[str, float]:
        """pass@1 / pass@k (and greedy pass@1) with the engine's current weights.

        `index_offset`: position of `records[0]` among all held-out records (a process's share
        in a multi-process run samples with the same seeds as one process would).

        Runs on this producer's scheduler: call it from the generator thread while the pipeline
        runs (`Pipeline.call_on_generator`), or when it is not running. Metrics as
        `jaxrl.data.evaluate.eval_metrics` defines them. `on_sample(n)`, if given, is called as
        completions finish (n of them; `len(records) * (pass_k + greedy)` in all): progress.
        """
        from jaxrl.data.evaluate import eval_metrics

        start = time.perf_counter()
        prompts = [self.task.render(r, self.tokenizer, self.cfg.prompt_format) for r in records]

        errors = [0]

        def sample_rewards(n: int, temp: float) -> np.ndarray:
            if self.env_runner is not None:  # multi-turn: the episodes' rewards
                sampling = [SamplingParams(max_tokens=self.cfg.max_new_tokens, temperature=temp,
                                           n=n, seed=request_seed(seed, -1, n, index_offset + i))
                            for i in range(len(records))]
                eps = self.env_runner.run(records, prompts, sampling)
                if on_sample is not None:
                    on_sample(n * len(records))
                return np.asarray([[e.reward for e in g] for g in eps], np.float64)
            ids = [self.scheduler.submit(p, SamplingParams(
                max_tokens=self.cfg.max_new_tokens, temperature=temp, n=n,
                seed=request_seed(seed, -1, n, index_offset + i))) for i, p in enumerate(prompts)]
            done = {rid: [] for rid in ids}
            for c in self.scheduler.run():
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

    def produce(self, step: int, weights: Callable[[], tuple[Any, int]]) -> Produced:
        start = time.perf_counter()
        self._install(weights)
        self.scheduler.reset_stats()
        c = self.cfg
        buffer = RolloutBuffer(filter_zero_variance=c.filter_zero_variance)
        fallback: list[Group] = []
        reward_metrics: list[dict] = []
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
                groups, metrics = self._episodes(records, step, rounds, weights)
            else:
                completions = self._generate(records, step, rounds, weights)
                groups, metrics = self._score(records, completions)
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
        if self.data_states is not None:  # what a checkpoint after training this batch saves
            self.data_states.record(step)
        chosen = buffer.take(c.prompts_per_step)
        dropped_extra = len(buffer)
        filler = fallback[: c.prompts_per_step - len(chosen)]
        groups = chosen + filler
        gen = self.scheduler.stats
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
        samples = self._samples(groups)
        self.samples[step] = samples
        for old in [s for s in self.samples if s < step - KEEP_SAMPLES_STEPS]:
            del self.samples[old]
        return Produced(
            step=step, payload=groups, num_rollouts=n_rollouts,
            num_tokens=sum(g.num_tokens for g in groups), busy_s=time.perf_counter() - start,
            min_version=min(g.min_version for g in groups),
            metrics=metrics, samples=samples,
        )
