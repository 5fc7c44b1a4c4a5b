"""Discrete-event simulation of the RL pipeline over many steps.

What is simulated: response lengths drawn from the workload's long-tailed distribution;
continuous batching on the generator (a fixed number of decode slots; every active sequence
advances one token per decode step, whose duration depends on how many slots are busy and how
much KV they hold, from `GeneratorModel.step_time`); prefill pauses; a sandbox pool of finite
size scoring each sample (FIFO, log-normal execution times of mean
`Workload.sandbox_s_per_sample`: a multi-turn episode's tool calls are lumped with its reward
after its generation, so the pool's load and the sample's latency are counted, not the slot a
turn frees while its tool runs); groups whose rewards have zero
variance being dropped and regenerated; and the trainer, which after each step publishes the new
weights (weight sync, blocking the trainer, as jaxrl's controller does) before the next. The
generator may start batch b once version b - ahead is published (ahead: sync 0, periodic 1,
async k) and uses the newest weights; batches are generated one after the other, each ending
with its longest response (the barrier). `inflight` (PipelineRL-style) has no barrier: free
slots are refilled at once with up to (1 + k) batches issued and not yet trained on, newest
weights are swapped in between decode steps, and the trainer takes the first B samples ready
(whole groups); a sample's staleness is that of its oldest token. (jaxrl's controller currently
runs `inflight` batch by batch, like `async` plus mid-batch swaps.)

Outputs per step wall-clock, idle fractions, the staleness histogram, sample accounting
(produced = consumed + dropped + buffered) and a Chrome/Perfetto trace with the controller's
`TraceWriter`, so simulated and measured timelines compare side by side.
"""

from __future__ import annotations

import collections
import dataclasses
import heapq
import math
from typing import Protocol

import numpy as np

from jaxrl.config.sections import lead_for
from jaxrl.planner.analytic import (
    MODES,
    check_mode,
    generator_model,
    trainer_model,
    weight_sync_s,
)
from jaxrl.planner.hardware import HardwareSpec
from jaxrl.planner.specs import Efficiency, ModelSpec, Workload
from jaxrl.trace import TraceWriter

_EPS = 1e-9


class GeneratorTiming(Protocol):
    replicas: int
    slots: int  # per replica

    @property
    def prefill_s(self) -> float: ...

    def step_time(self, b: float, kv_tokens: float) -> float: ...


class TrainerTiming(Protocol):
    def batch_seconds(self, tokens: float, tokens_sq: float) -> float: ...


@dataclasses.dataclass(frozen=True)
class SimConfig:
    mode: str = "periodic"
    steps: int = 20
    staleness: int = 1          # async: max versions behind; inflight: batches of run-ahead
    sandbox_workers: int = 0    # 0: unlimited (no queueing)
    sandbox_sigma: float = 0.5  # log-normal shape of sandbox execution times
    seed: int = 0
    trace: bool = True

    def __post_init__(self):
        check_mode(self.mode)
        if self.steps < 1 or self.staleness < 0 or self.sandbox_workers < 0:
            raise ValueError(f"need steps >= 1, staleness >= 0, sandbox_workers >= 0; got "
                             f"{self.steps}, {self.staleness}, {self.sandbox_workers}")
        if self.mode == "inflight" and self.staleness < 1:
            raise ValueError("inflight needs staleness >= 1 (one batch of run-ahead)")


@dataclasses.dataclass(frozen=True)
class SimResult:
    config: SimConfig
    step_end_s: np.ndarray
    trainer_idle: float  # waiting for a batch (as the controller's pipeline/trainer_idle_frac)
    train_frac: float    # computing train steps (the MFU fraction); the rest is publishing
    generator_idle: float
    slot_utilization: float
    staleness_hist: dict[int, int]
    started: int
    produced: int       # generated and scored
    consumed: int
    dropped: int        # zero-variance groups filtered out
    buffered: int       # produced, neither consumed nor dropped when the run ended
    in_flight: int      # started, not yet produced
    trace: TraceWriter | None

    @property
    def step_s(self) -> np.ndarray:
        return np.diff(self.step_end_s, prepend=0.0)

    @property
    def wall_s(self) -> float:
        return float(self.step_end_s[-1])

    @property
    def consumed_per_s(self) -> float:
        return self.consumed / self.wall_s if self.wall_s > 0 else math.inf

    @property
    def steady_consumed_per_s(self) -> float:
        """Consumed samples/s after the first quarter of the steps (no pipeline fill)."""
        e, batch = self.step_end_s, self.consumed / len(self.step_end_s)
        q = len(e) // 4
        if q == 0 or e[-1] <= e[q - 1]:
            return self.consumed_per_s
        return batch * (len(e) - q) / float(e[-1] - e[q - 1])

    @property
    def staleness_max(self) -> int:
        return max(self.staleness_hist, default=0)

    def summary(self) -> dict[str, float]:
        steady = self.step_s[len(self.step_s) // 4:]
        return {"step_s_median": float(np.median(steady)), "wall_s": self.wall_s,
                "consumed_per_s": self.consumed_per_s,
                "steady_consumed_per_s": self.steady_consumed_per_s,
                "trainer_idle": self.trainer_idle, "train_frac": self.train_frac,
                "generator_idle": self.generator_idle, "slot_utilization": self.slot_utilization,
                "staleness_max": self.staleness_max}


class _Sim:
    def __init__(self, w: Workload, gen: GeneratorTiming, trainer: TrainerTiming, sync_s: float,
                 cfg: SimConfig):
        self.w, self.gen, self.trainer, self.sync_s, self.cfg = w, gen, trainer, sync_s, cfg
        self.rng = np.random.default_rng(cfg.seed)
        self.trace = TraceWriter(process_name=f"simulated {cfg.mode}") if cfg.trace else None
        self.t = 0.0
        n = gen.replicas * gen.slots
        self.rem = np.zeros(n)                 # tokens left per slot
        self.sid = np.full(n, -1, np.int64)    # sample in the slot, -1 free
        self.pending: collections.deque[int] = collections.deque()
        self.pause_until = 0.0  # prefill: decoding paused
        self.gen_version, self.gen_batch = 0, -1
        self.busy_since: float | None = None
        self.busy_name = "decode" if cfg.mode == "inflight" else "produce"
        self.busy_args: dict[str, int] = {}
        # Samples and groups.
        self.length: list[int] = []
        self.batch_of: list[int] = []
        self.version: list[int] = []
        self.group_of: list[int] = []
        self.group_left: list[int] = []
        self.group_drop: list[bool] = []
        self.group_batch: list[int] = []
        self.group_first: list[int] = []
        self.alive = collections.Counter()        # batch -> issued samples not dropped
        self.gen_left = collections.Counter()     # batch -> issued samples not yet generated
        self.ready: dict[int, list[int]] = collections.defaultdict(list)  # batch -> ready ids
        self.fifo: collections.deque[int] = collections.deque()            # inflight
        self.ready_heap: list[tuple[float, int]] = []
        self.workers = [0.0] * cfg.sandbox_workers
        self.in_sandbox = 0
        # Trainer.
        self.done, self.busy_until, self.phase, self.free_since = 0, None, "", 0.0
        self.step_end: list[float] = []
        self.train_time = self.gen_busy = self.slot_time = 0.0
        self.stale = collections.Counter()
        self.produced = self.consumed = self.dropped = 0
        self.last_counter = -1

    # -- samples ---------------------------------------------------------------------------

    def _new_group(self, batch: int, front: bool = False) -> None:
        g, G = len(self.group_left), self.w.group_size
        self.group_left.append(G)
        self.group_drop.append(bool(self.rng.random() < self.w.zero_variance_frac))
        self.group_batch.append(batch)
        self.group_first.append(len(self.length))
        ids = range(len(self.length), len(self.length) + G)
        self.length += self.w.sample_responses(self.rng, G).tolist()
        self.batch_of += [batch] * G
        self.group_of += [g] * G
        self.version += [-1] * G
        self.alive[batch] += G
        self.gen_left[batch] += G
        (self.pending.extendleft(reversed(ids)) if front else self.pending.extend(ids))

    def _sample_ready(self, i: int) -> None:
        self.produced += 1
        self.in_sandbox -= 1
        g = self.group_of[i]
        self.group_left[g] -= 1
        if self.group_left[g]:
            return
        ids = list(range(self.group_first[g], self.group_first[g] + self.w.group_size))
        b = self.group_batch[g]
        if self.group_drop[g]:
            self.dropped += len(ids)
            self.alive[b] -= len(ids)
            if self.cfg.mode != "inflight":
                self._new_group(b, front=True)  # regenerate for the same batch
        elif self.cfg.mode == "inflight":
            self.fifo.extend(ids)
        else:
            self.ready[b].extend(ids)

    # -- sandbox ---------------------------------------------------------------------------

    def _submit(self, i: int) -> None:
        self.in_sandbox += 1
        mean = self.w.sandbox_s_per_sample  # tool calls + reward, after generation (see doc)
        dur = 0.0
        if mean > 0:
            s = self.cfg.sandbox_sigma
            dur = float(self.rng.lognormal(math.log(mean) - s * s / 2, s))
        start = self.t
        if self.workers:
            start = max(self.t, heapq.heappop(self.workers))
            heapq.heappush(self.workers, start + dur)
        heapq.heappush(self.ready_heap, (start + dur, i))
        self._counter("sandbox", "in_sandbox", samples=self.in_sandbox)

    def _pop_ready(self) -> bool:
        changed = False
        while self.ready_heap and self.ready_heap[0][0] <= self.t + _EPS:
            self._sample_ready(heapq.heappop(self.ready_heap)[1])
            changed = True
        return changed

    # -- trainer ---------------------------------------------------------------------------

    def _batch_available(self) -> list[int] | None:
        B, s = self.w.batch_size, self.done
        if self.cfg.mode == "inflight":
            if len(self.fifo) < B:
                return None
            return [self.fifo.popleft() for _ in range(B)]
        if len(self.ready[s]) < B:
            return None
        return self.ready.pop(s)

    def _trainer_tick(self) -> bool:
        if self.busy_until is not None:
            if self.busy_until > self.t + _EPS:
                return False
            if self.phase == "train":  # then publish the new weights (blocks the trainer)
                self.phase = "publish"
                self.busy_until = self.t + self.sync_s
                if self.trace and self.sync_s > 0:
                    self.trace.add("weight_sync", "reshard", self.t, self.sync_s,
                                   version=self.done + 1)
                return True
            self.done += 1  # version `done` is now available to the generator
            self.step_end.append(self.t)
            self.busy_until, self.free_since = None, self.t
            return True
        if self.done >= self.cfg.steps:
            return False
        ids = self._batch_available()
        if ids is None:
            return False
        s = self.done
        for i in ids:
            self.stale[s - self.version[i]] += 1
        self.consumed += len(ids)
        lengths = np.array([self.length[i] for i in ids], dtype=np.float64) + self.w.prompt_len
        dur = self.trainer.batch_seconds(float(lengths.sum()), float((lengths**2).sum()))
        self.train_time += dur
        self.phase, self.busy_until = "train", self.t + dur
        if self.trace:
            if self.t > self.free_since:
                self.trace.add("trainer", "wait_batch", self.free_since, self.t - self.free_since,
                               step=s)
            self.trace.add("trainer", "train_step", self.t, dur, step=s, samples=len(ids),
                           staleness_mean=float(np.mean([s - self.version[i] for i in ids])))
        return True

    # -- generator -------------------------------------------------------------------------

    @property
    def _lead(self) -> int:
        return lead_for(check_mode(self.cfg.mode), self.cfg.staleness)

    def _admit(self) -> bool:
        B, G = self.w.batch_size, self.w.group_size
        if self.cfg.mode == "inflight":
            self.gen_version = self.done  # newest weights, swapped in between decode steps
            limit = (self.done + 1 + self.cfg.staleness) * B
            free = int((self.sid < 0).sum()) - len(self.pending)
            changed = False
            while free > 0 and self.alive[0] + G <= limit:  # inflight: all groups in "batch" 0
                self._new_group(0)
                free -= G
                changed = True
            return changed
        b = self.gen_batch
        if b >= 0 and (self.alive[b] < B or self.gen_left[b] > 0):
            return False  # still generating batch b (or waiting to regenerate dropped groups)
        if self.done < b + 1 - self._lead or b + 1 >= self.cfg.steps:
            return False
        self.gen_batch = b + 1
        self.gen_version = self.done  # the newest published weights, for the whole batch
        self._close_busy()
        self.busy_args = {"step": b + 1, "version": self.gen_version}
        for _ in range(B // G):
            self._new_group(b + 1)
        return True

    def _fill_slots(self) -> bool:
        free = np.flatnonzero(self.sid < 0)
        n = min(len(free), len(self.pending))
        if n == 0:
            return False
        for slot in free[:n]:
            i = self.pending.popleft()
            self.sid[slot], self.rem[slot] = i, self.length[i]
            self.version[i] = self.gen_version
        self.pause_until = self.t + n * self.gen.prefill_s / self.gen.replicas
        return True

    def _generator_tick(self) -> bool:
        if self.pause_until > self.t + _EPS:
            return False
        return self._admit() or self._fill_slots()

    def _step_time(self, active: np.ndarray) -> float:
        R = self.gen.replicas
        kv = float((self.w.prompt_len + np.array([self.length[i] for i in self.sid[active]])
                    - self.rem[active]).sum())
        return self.gen.step_time(active.sum() / R, kv / R)

    def _close_busy(self) -> None:
        if self.busy_since is not None:
            if self.trace and self.t > self.busy_since:
                self.trace.add("generator", self.busy_name, self.busy_since,
                               self.t - self.busy_since, **self.busy_args)
            self.busy_since = None

    def _counter(self, track: str, name: str, **values: float) -> None:
        if self.trace:
            self.trace.counter(track, name, self.t, **values)

    # -- event loop ------------------------------------------------------------------------

    def _next_time(self, active: np.ndarray, step: float) -> float:
        times = []
        if self.busy_until is not None:
            times.append(self.busy_until)
        if self.pause_until > self.t + _EPS:
            times.append(self.pause_until)
        elif active.any():
            times.append(self.t + float(self.rem[active].min()) * step)
        if self.ready_heap:
            times.append(self.ready_heap[0][0])
        if not times:
            raise RuntimeError(
                f"simulation stalled at t={self.t:.3f}s, step {self.done}: mode {self.cfg.mode}, "
                f"{len(self.pending)} pending, batch {self.gen_batch}")
        return max(min(times), self.t)

    def _advance(self) -> None:
        active = self.sid >= 0
        decoding = self.pause_until <= self.t + _EPS and active.any()
        step = self._step_time(active) if decoding else 0.0
        t_next = self._next_time(active, step)
        dt = t_next - self.t
        busy = decoding or self.pause_until > self.t + _EPS  # decoding or prefilling
        if busy and self.busy_since is None:
            self.busy_since = self.t
        elif not busy:
            self._close_busy()
        if busy:
            self.gen_busy += dt
        self.slot_time += dt * int(active.sum())
        if decoding:
            self.rem[active] = self.rem[active] - dt / step if step > 0 else 0.0
        self.t = t_next
        finished = np.flatnonzero(active & (self.rem <= _EPS)) if decoding else []
        for slot in finished:
            i = int(self.sid[slot])
            self.sid[slot] = -1
            self.gen_left[self.batch_of[i]] -= 1
            self._submit(i)
        n_active = int((self.sid >= 0).sum())
        if len(finished) and (n_active == 0 or abs(n_active - self.last_counter)
                              >= max(1, self.sid.size // 50)):
            self.last_counter = n_active
            self._counter("generator", "active_slots", slots=n_active)

    def run(self) -> SimResult:
        while self.done < self.cfg.steps:
            changed = True
            while changed:
                changed = self._pop_ready() | self._trainer_tick() | self._generator_tick()
            if self.done >= self.cfg.steps:
                break
            self._advance()
        self._close_busy()
        wall = self.step_end[-1]
        in_gen = int((self.sid >= 0).sum())
        return SimResult(
            self.cfg, np.array(self.step_end),
            1 - (self.train_time + self.cfg.steps * self.sync_s) / wall, self.train_time / wall,
            1 - self.gen_busy / wall, self.slot_time / (self.sid.size * wall),
            dict(sorted(self.stale.items())), started=len(self.length) - len(self.pending),
            produced=self.produced, consumed=self.consumed, dropped=self.dropped,
            buffered=self.produced - self.consumed - self.dropped,
            in_flight=in_gen + self.in_sandbox, trace=self.trace)


def simulate(workload: Workload, generator: GeneratorTiming, trainer: TrainerTiming,
             sync_s: float, config: SimConfig = SimConfig()) -> SimResult:
    """Runs the pipeline for `config.steps` trainer steps (see the module docstring)."""
    if sync_s < 0:
        raise ValueError(f"sync_s must be >= 0, got {sync_s}")
    return _Sim(workload, generator, trainer, sync_s, config).run()


def simulate_split(model: ModelSpec, hw: HardwareSpec, workload: Workload, eff: Efficiency,
                   trainer_chips: int, generator_chips: int,
                   config: SimConfig = SimConfig()) -> SimResult:
    """`simulate` with the analytic model's generator, trainer and weight-sync costs."""
    gen = generator_model(model, hw, workload, eff, generator_chips)
    tr = trainer_model(model, hw, workload, eff, trainer_chips)
    sync = weight_sync_s(model, hw, eff, trainer_chips, gen.replica_chips,
                         trainer_chips + generator_chips)
    return simulate(workload, gen, tr, sync, config)


__all__ = ["MODES", "SimConfig", "SimResult", "simulate", "simulate_split"]
