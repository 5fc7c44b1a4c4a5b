"""Multi-turn episodes on the continuous-batching scheduler: a turn is a generation request.

    runner = EpisodeRunner(scheduler, tokenizer, get_env("python_tool"), sessions=session_pool)
    groups = runner.run(records, prompts, sampling)     # list (per record) of lists of Episode

The generator never waits for a tool: when a turn ends (EOS or a stop string) its slot is free at
once and serves other sequences; the environment's `step` runs on a tool thread; when the
observation returns, the episode's next turn is submitted as a new request whose prompt is the
whole sequence so far (re-prefilled; docs/design.md says why). The first turn of a group's `n`
episodes is one request (one prefill). Token ids are kept end to end: the model's tokens as
sampled, the observation's as encoded, never a decode -> re-encode round trip.

`blocking=True` is the comparison a benchmark needs: an episode holds a slot from its first turn
to its end, tool calls included (at most `num_slots` episodes live), as an engine whose slot
waits on its tool call would.
"""

from __future__ import annotations

import concurrent.futures
import contextlib
import dataclasses
import hashlib
import logging
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np

from jaxrl.envs.base import Environment, Step, Tools, get_env, split_stops
from jaxrl.generate.sampling import SamplingParams
from jaxrl.generate.scheduler import Scheduler
from jaxrl.generate.stops import StopText
from jaxrl.sandbox import SessionPool
from jaxrl.trace import TraceWriter

log = logging.getLogger(__name__)


@dataclasses.dataclass(eq=False)
class Episode:
    """One episode's sequence after its prompt: `tokens[i]` is a model token (`mask[i] == 1`,
    with its behaviour logprob and policy version) or an observation token (`mask[i] == 0`,
    logprob 0, the version of the model token before it)."""

    record: Mapping[str, Any]
    prompt: list[int]
    tokens: list[int] = dataclasses.field(default_factory=list)
    mask: list[int] = dataclasses.field(default_factory=list)
    logprobs: list[float] = dataclasses.field(default_factory=list)
    versions: list[int] = dataclasses.field(default_factory=list)
    turns: int = 0
    reward: float = 0.0
    done: bool = False
    ended_by: str = ""  # done | turns | tokens | wall | session:<limit>
    finish_reason: str = "stop"
    tool_s: list[float] = dataclasses.field(default_factory=list)
    started: float = dataclasses.field(default_factory=time.perf_counter)

    def add_turn(self, tokens, logprobs, versions) -> None:
        self.tokens += list(tokens)
        self.mask += [1] * len(tokens)
        self.logprobs += list(logprobs)
        self.versions += list(versions)
        self.turns += 1

    def add_observation(self, ids: Sequence[int]) -> None:
        version = self.versions[-1] if self.versions else 0
        self.tokens += list(ids)
        self.mask += [0] * len(ids)
        self.logprobs += [0.0] * len(ids)
        self.versions += [version] * len(ids)


def turn_seed(base: int, sample: int, turn: int) -> int:
    digest = hashlib.sha256(f"{base}/{sample}/{turn}".encode()).digest()
    return int.from_bytes(digest[:8], "little") >> 1


@dataclasses.dataclass
class EnvStats:
    """Counters of one `run`."""

    episodes: int = 0
    turns: int = 0
    tool_calls: int = 0
    tool_latencies: list[float] = dataclasses.field(default_factory=list)
    wall_s: float = 0.0
    wait_tools_s: float = 0.0  # the generator had nothing to decode: every episode was on a tool
    slots_waiting_on_tools: float = 0.0  # mean over chunks of slots held by a waiting episode
    session_endings: int = 0

    def metrics(self) -> dict[str, float]:
        lat = np.asarray(self.tool_latencies or [0.0])
        return {"env/turns_mean": self.turns / max(self.episodes, 1),
                "env/tool_calls_per_s": self.tool_calls / max(self.wall_s, 1e-9),
                "env/tool_latency_p50": float(np.percentile(lat, 50)),
                "env/tool_latency_p99": float(np.percentile(lat, 99)),
                "env/generator_wait_tools_s": self.wait_tools_s,
                "env/session_penalties": float(self.session_endings),
                "generator/slots_waiting_on_tools": self.slots_waiting_on_tools}


class EpisodeRunner:
    """Runs episodes of one environment class to completion on `scheduler`.

    Args:
      max_tokens: the episode's budget of tokens after the prompt (model + observation).
      tool_threads: environment steps run at once.
      blocking: an episode holds a slot for its whole life (the comparison; see module doc).
      trace: the run's trace; each tool call becomes a `tool_call` span on its `sandbox` track
        (start and duration on the trace's clock; args: status, episode, turn).
    """

    def __init__(self, scheduler: Scheduler | None, tokenizer, env_cls: type[Environment], *,
                 sessions=None, max_tokens: int, tool_threads: int = 8,
                 tool_timeout_s: float = 5.0, blocking: bool = False, max_live: int = 0,
                 score_for: Callable[[Mapping], Callable[[str], float]] | None = None,
                 trace: TraceWriter | None = None):
        self.scheduler, self.tokenizer, self.env_cls = scheduler, tokenizer, env_cls
        self.trace = trace
        self.sessions, self.max_tokens, self.blocking = sessions, int(max_tokens), blocking
        self.tool_timeout_s, self.score_for = tool_timeout_s, score_for
        # Episodes live at once: each may hold a tool session, so never more than the session
        # slots (a tool thread waiting for a slot held by an episode that waits for a tool
        # thread would deadlock); blocking: never more than the engine's slots.
        limits = [max_live or 1 << 30, sessions.num_slots if sessions is not None else 1 << 30]
        self.max_live = min(limits)
        self.stop_ids, strings = split_stops(tokenizer, env_cls.stops(tokenizer))
        self.stop_text = (StopText(strings, lambda ids: tokenizer.decode(ids, errors="replace"))
                          if strings else None)
        self._pool = concurrent.futures.ThreadPoolExecutor(tool_threads,
                                                           thread_name_prefix="env-tool")
        self.stats = EnvStats()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def make_env(self, record) -> Environment:
        score = self.score_for(record) if self.score_for is not None else None
        clock = self.trace.now if self.trace is not None else time.perf_counter
        return self.env_cls(record, Tools(self.sessions, timeout_s=self.tool_timeout_s,
                                          score=score, clock=clock))

    def _turn_params(self, ep: Episode, base: SamplingParams, sample: int, n: int = 1
                     ) -> SamplingParams | None:
        left = self.max_tokens - len(ep.tokens)
        cap = self.env_cls.turn_max_tokens or left
        if left < 1:
            return None
        return dataclasses.replace(base, n=n, max_tokens=min(cap, left),
                                   stop_token_ids=self.stop_ids,
                                   seed=base.seed if ep.turns == 0 else
                                   turn_seed(base.seed, sample, ep.turns))

    def run(self, records: Sequence[Mapping], prompts: Sequence[list[int]],
            sampling: Sequence[SamplingParams], on_chunk: Callable[[], None] | None = None,
            scheduler: Scheduler | None = None) -> list[list[Episode]]:
        """`sampling[i].n` episodes of `records[i]` (prompt ids `prompts[i]`), all to the end,
        on `scheduler` (default: the runner's own; a run passes its current one)."""
        t0 = time.perf_counter()
        st = self.stats = EnvStats()
        sched = scheduler or self.scheduler
        max_live = min(self.max_live, sched.engine.num_slots) if self.blocking else self.max_live
        groups = [[Episode(r, list(p)) for _ in range(sp.n)]
                  for r, p, sp in zip(records, prompts, sampling, strict=True)]
        envs = {id(ep): self.make_env(ep.record) for g in groups for ep in g}
        owner: dict[int, tuple[int, list[int]]] = {}  # request id -> (group, episode indices)
        pending_first = list(range(len(groups)))
        tools: dict[concurrent.futures.Future, tuple[int, int]] = {}
        live = 0  # episodes started and not ended
        chunks = waiting_slot_sum = 0

        def submit(gi: int, ks: list[int]) -> bool:
            ep = groups[gi][ks[0]]
            sp = self._turn_params(ep, sampling[gi], ks[0], len(ks))
            if sp is None:
                return False
            owner[sched.submit(ep.prompt + ep.tokens, sp, stop_text=self.stop_text)] = (gi, ks)
            return True

        def finish(ep: Episode, why: str) -> None:
            nonlocal live
            if why not in ("done",) and not why.startswith("session"):
                ep.reward += envs[id(ep)].on_budget()
            ep.done, ep.ended_by = True, why
            envs[id(ep)].tools.close()
            live -= 1

        while True:
            # Admit first turns (blocking mode: only while a slot is free for a whole group).
            while pending_first and (live == 0 or
                                     live + len(groups[pending_first[0]]) <= max_live):
                gi = pending_first.pop(0)
                live += len(groups[gi])
                submit(gi, list(range(len(groups[gi]))))
            if sched.has_work():
                completions = sched.step()
                chunks += 1
                if self.blocking:
                    waiting_slot_sum += len(tools)  # episodes on a tool, holding a slot
                if on_chunk is not None:
                    on_chunk()
            elif tools:
                t_wait = time.perf_counter()
                concurrent.futures.wait(tools, return_when=concurrent.futures.FIRST_COMPLETED)
                st.wait_tools_s += time.perf_counter() - t_wait
                completions = []
            elif not pending_first:
                break
            else:
                completions = []
            for c in completions:
                gi, ks = owner[c.request_id]  # n samples share a first-turn request
                k = ks[c.sample_index] if len(ks) > 1 else ks[0]
                ep = groups[gi][k]
                ep.add_turn(c.tokens, c.logprobs, c.versions)
                ep.finish_reason = c.finish_reason
                st.turns += 1
                action = self.tokenizer.decode(c.tokens, errors="replace")
                env = envs[id(ep)]
                tools[self._pool.submit(env.step, action)] = (gi, k)
            for fut in [f for f in tools if f.done()]:
                gi, k = tools.pop(fut)
                ep, env = groups[gi][k], envs[id(groups[gi][k])]
                if fut.exception() is not None:
                    log.error("environment step failed: %r", fut.exception())
                step = fut.result() if fut.exception() is None else Step(done=True)
                new_calls = env.tools.calls[len(ep.tool_s):]
                st.tool_calls += len(new_calls)
                ep.tool_s += [c.dur_s for c in new_calls]
                if self.trace is not None:
                    for c in new_calls:
                        self.trace.add("sandbox", "tool_call", c.start_s, c.dur_s,
                                       status=c.status, episode=f"{gi}.{k}", turn=ep.turns)
                ep.reward += float(step.reward)
                if env.tools.broken:
                    ep.reward = env.session_penalty
                    st.session_endings += 1
                    finish(ep, f"session:{env.tools.broken}")
                    continue
                if step.done:
                    finish(ep, "done")
                    continue
                if ep.turns >= env.max_turns:
                    finish(ep, "turns")
                    continue
                if time.perf_counter() - ep.started > env.max_wall_s:
                    finish(ep, "wall")
                    continue
                obs = list(self.tokenizer.encode(step.observation)) if step.observation else []
                room = self.max_tokens - len(ep.tokens)
                ep.add_observation(obs[:max(room, 0)])
                if len(obs) >= room or not submit(gi, [k]):
                    finish(ep, "tokens")
        st.episodes = sum(len(g) for g in groups)
        st.tool_latencies = [t for g in groups for ep in g for t in ep.tool_s]
        st.wall_s = time.perf_counter() - t0
        st.slots_waiting_on_tools = waiting_slot_sum / max(chunks, 1)
        return groups


def build_runner(cfg, task, tokenizer, scorer, closers: contextlib.ExitStack,
                 trace: TraceWriter | None = None) -> EpisodeRunner | None:
    """The run's episode runner when its task names an environment (else None): a session pool
    sized for the episodes of one step (at most 32 live at once), the task's reward as the
    environments' trusted verdict, tool calls as spans on `trace`."""
    if not task.env:
        return None
    env_cls = get_env(task.env)
    per_step = cfg.data.prompts_per_step * cfg.data.group_size
    sessions = SessionPool(min(per_step, 32), tier=cfg.rewards.tier)
    closers.callback(sessions.close)

    def score_for(record):
        return lambda text: float(scorer.score_batch(task.reward_items([record], [text])).total[0])

    runner = EpisodeRunner(None, tokenizer, env_cls, sessions=sessions,  # the run's scheduler
                           max_tokens=cfg.data.max_new_tokens, score_for=score_for,
                           tool_timeout_s=cfg.rewards.timeout_s, trace=trace)
    closers.callback(runner.close)
    log.info("multi-turn episodes: environment %s, %d tool session slots (tier %s)", task.env,
             sessions.num_slots, sessions.tier)
    return runner
