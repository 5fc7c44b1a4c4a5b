"""The analytic throughput model: rates of the generator, the trainer and the pipeline.

Generator (one replica of p chips, continuous batching with b slots holding K KV tokens):

    decode step  t(b, K) = max( (params_read(b) * B_w + K * kv_bytes) / (p * BW * eff_bw),
                                (2 N_active b + 4 L H d K) / (p * peak * mfu_decode) )
    prefill      t_pre   = (2 N_active P' + 4 L H d P'^2 / 2) / (p * peak * mfu_prefill)
                 with P' = P / G when a group shares its prompt's prefill
    slots        b = min(max_slots, (p * HBM * f_mem - N_total * B_w) / (kv_bytes * K_slot))
                 K_slot = P + E[R^2] / (2 E[R])  (length-biased resident KV per slot)
    samples/s    = replicas / (E[R] * t(b, b K_slot) / b + t_pre)

Trainer (C_t chips): FLOPs per sample F = (6 epochs + 2 logprob_passes) N_active E[T]
(+ the same multiples of the causal attention term 4 L H d E[T^2] / 2), samples/s =
C_t * peak * MFU_train / F.

Weight sync: N_total * B_w bytes broadcast (pipelined) from the trainer shards to every
replica: t = bytes / (min(C_t, p) * link_bw * eff_sync) + latency, link = NVLink/ICI inside one
node, the per-chip NIC across nodes.

Pipeline. The trainer publishes the new weights after each step (weight sync, blocking the
trainer, as jaxrl's controller does); the generator may start batch b once version b - a is
published (a = ahead: sync 0, periodic 1, async k) and generates batches one after another.
With batch B, zero-variance fraction z, training time X = B / trainer_rate, sync S, sandbox
latency Q and barrier time G_b = the time for B / (1 - z) samples started together to finish
(`batch_s`: per replica m samples, decode steps summed over positions x with m * P(R > x)
sequences still active, up to the expected longest response: the long tail), one cycle
generate -> score -> train -> publish of length G_b + Q + X + S unlocks a + 1 batches, so

    sync / periodic / async   step = max(G_b, X + S, (G_b + Q + X + S) / (a + 1))
    inflight                  step = max(W, X + S)

(sync: G_b + Q + X + S). Inflight has no barrier; W = B / (1 - z) / rate, the rate Little's law
allows with k + 1/2 batches in generation, each sample resident until its group's longest member
is done. Consumed samples/s = B / step; trainer idle (waiting for data) = 1 - (X + S) / step;
MFU = MFU_train * X / step.
"""

from __future__ import annotations

import dataclasses
import math

from jaxrl.config.sections import PIPELINE_MODES, lead_for
from jaxrl.planner.hardware import HardwareSpec
from jaxrl.planner.specs import Efficiency, ModelSpec, Workload
from jaxrl.rounding import next_power_of_two

MODES = PIPELINE_MODES  # defined once, with the config


class Infeasible(ValueError):
    """A split that cannot run (weights do not fit, too few chips for one replica, ...)."""


def check_mode(mode: str) -> str:
    if mode not in MODES:
        raise ValueError(f"unknown pipeline mode {mode!r}; valid: {list(MODES)}")
    return mode


@dataclasses.dataclass(frozen=True)
class GeneratorModel:
    """Decode/prefill costs of one generator replica and the fleet's steady-state rate."""

    model: ModelSpec
    hw: HardwareSpec
    workload: Workload
    eff: Efficiency
    replica_chips: int
    replicas: int
    slots: int  # per replica

    @property
    def kv_bytes_per_token(self) -> float:
        """KV bytes per token with every layer keeping it (see `kv_bytes`)."""
        return self.model.kv_elems_per_token * self.eff.gen_bytes_per_param

    def kv_bytes(self, b: float, kv_tokens: float) -> float:
        """KV bytes of `b` sequences holding `kv_tokens` tokens in all, each taken at the mean
        length (sliding layers keep at most their window: a mean over- rather than
        under-counts them, min being concave)."""
        per_seq = self.model.kv_elems_per_sequence(kv_tokens / b) if b > 0 else 0.0
        return b * per_seq * self.eff.gen_bytes_per_param

    def step_time(self, b: float, kv_tokens: float) -> float:
        """Seconds of one decode step on one replica with `b` active sequences holding
        `kv_tokens` KV tokens in all."""
        if b <= 0:
            return 0.0
        m, hw, p = self.model, self.hw, self.replica_chips
        mem = m.params_read(b) * self.eff.gen_bytes_per_param + self.kv_bytes(b, kv_tokens)
        t_mem = mem / (p * hw.hbm_bw * self.eff.decode_bw_eff)
        flops = 2 * m.active_params * b
        if self.eff.count_attention:
            flops += m.attention_flops_per_token(kv_tokens)
        return max(t_mem, flops / (p * hw.peak_flops * self.eff.decode_mfu))

    @property
    def prefill_s(self) -> float:
        """Seconds of one replica to prefill one sample's prompt (shared across its group)."""
        w, m = self.workload, self.model
        tokens = w.prompt_len / w.group_size if w.prefix_sharing else w.prompt_len
        flops = 2 * m.active_params * tokens
        if self.eff.count_attention:
            flops += m.attention_flops_per_token(w.prompt_len / 2) * tokens
        return flops / (self.replica_chips * self.hw.peak_flops * self.eff.prefill_mfu)

    def samples_per_s_at(self, concurrency: float) -> float:
        """Fleet samples/s with `concurrency` sequences decoding per replica (at most `slots`)."""
        b = max(1.0, min(float(self.slots), concurrency))
        stats = self.workload.response_stats()
        step = self.step_time(b, b * stats.resident_kv_tokens)
        return self.replicas / (stats.mean * step / b + self.prefill_s)

    @property
    def samples_per_s(self) -> float:
        """Steady-state rate with every slot busy."""
        return self.samples_per_s_at(self.slots)

    @property
    def tokens_per_s(self) -> float:
        return self.samples_per_s * self.workload.response_stats().mean

    def bounded_rate(self, outstanding: float, latency_s: float = 0.0) -> float:
        """Samples/s when at most `outstanding` samples may be in flight (issued, not yet
        consumed), as in inflight mode: by Little's law at most outstanding / residence, where a
        sample resides until the longest of its group is decoded (GRPO needs the whole group)
        and scored (`latency_s`); a sample decodes only a part of that time."""
        w = self.workload
        longest = w.expected_longest(w.group_size)
        # Only the fraction E[R] / E[max of group] of resident samples is still decoding.
        active = outstanding / self.replicas * w.response_stats().mean / longest
        b = max(1.0, min(float(self.slots), active))
        step = self.step_time(b, b * w.response_stats().resident_kv_tokens)
        residence = longest * step + self.prefill_s + latency_s
        return min(self.samples_per_s_at(b), outstanding / residence)

    def wave_s(self, m: float, longest: float, points: int = 256) -> float:
        """Seconds for `m` sequences per replica started together to finish, the last at
        `longest` tokens: sum over positions x of t(active(x), KV(x)), with active(x) =
        max(1, m * P(R > x)) and KV(x) = active(x) * (prompt + x)."""
        w = self.workload
        dx = longest / points
        total = 0.0
        for j in range(points):
            x = (j + 0.5) * dx
            active = max(1.0, m * w.response_survival(x))
            total += dx * self.step_time(active, active * (w.prompt_len + x))
        return total

    def batch_s(self, n: float) -> float:
        """Seconds to generate a batch of `n` samples from an empty generator until its last
        sample finishes (the barrier of sync / periodic / async): a refill phase at full
        occupancy if the batch exceeds the slots, then the final wave with its long tail."""
        per_replica = n / self.replicas
        wave = min(per_replica, float(self.slots))
        refill = (per_replica - wave) / self.samples_per_s * self.replicas
        longest = self.workload.expected_longest(max(1, round(n)))
        return wave * self.prefill_s + refill + self.wave_s(wave, longest)


def replica_chips(model: ModelSpec, hw: HardwareSpec, eff: Efficiency) -> int:
    """Chips per generator replica: the override, else the smallest power of two whose usable
    memory holds the weights twice (half of it left for the KV cache)."""
    if eff.gen_replica_chips:
        return eff.gen_replica_chips
    weights = model.total_params * eff.gen_bytes_per_param
    p = next_power_of_two(weights / (0.5 * hw.hbm_bytes * eff.kv_mem_frac))
    if p > 4096:
        raise Infeasible(f"{model.name} weights ({weights:.3g} B) need > 4096 {hw.name} chips")
    return p


def generator_model(model: ModelSpec, hw: HardwareSpec, workload: Workload, eff: Efficiency,
                    chips: int) -> GeneratorModel:
    p = replica_chips(model, hw, eff)
    if chips < p:
        raise Infeasible(f"generator needs >= {p} {hw.name} chips per replica of {model.name}, "
                         f"got {chips}")
    free = p * hw.hbm_bytes * eff.kv_mem_frac - model.total_params * eff.gen_bytes_per_param
    per_slot = (model.kv_elems_per_sequence(workload.response_stats().resident_kv_tokens)
                * eff.gen_bytes_per_param)
    slots = min(eff.max_slots, int(free // per_slot)) if free > 0 else 0
    if slots < 1:
        raise Infeasible(f"no KV memory left for one sequence on a {p}-chip {hw.name} replica")
    return GeneratorModel(model, hw, workload, eff, p, chips // p, slots)


@dataclasses.dataclass(frozen=True)
class TrainerModel:
    model: ModelSpec
    hw: HardwareSpec
    workload: Workload
    eff: Efficiency
    chips: int

    @property
    def flops_per_sample(self) -> float:
        return trainer_flops_per_sample(self.model, self.workload, self.eff.count_attention)

    @property
    def samples_per_s(self) -> float:
        return self.chips * self.hw.peak_flops * self.eff.trainer_mfu / self.flops_per_sample

    def batch_seconds(self, tokens: float, tokens_sq: float) -> float:
        """Training seconds for a batch with sum of sample lengths `tokens` and of squared
        lengths `tokens_sq` (the simulator's per-batch cost)."""
        w, m = self.workload, self.model
        flops = (6 * w.epochs + 2 * w.logprob_passes) * m.active_params * tokens
        if self.eff.count_attention:
            flops += (3 * w.epochs + w.logprob_passes) * m.attention_flops_per_token(1) * (
                tokens_sq / 2)
        return flops / (self.chips * self.hw.peak_flops * self.eff.trainer_mfu)


def trainer_flops_per_sample(model: ModelSpec, workload: Workload, attention: bool = True) -> float:
    """(6 epochs + 2 logprob_passes) N_active E[T] (+ causal attention)."""
    s = workload.response_stats()
    flops = (6 * workload.epochs + 2 * workload.logprob_passes) * model.active_params * (
        s.sample_mean)
    if attention:
        flops += (3 * workload.epochs + workload.logprob_passes) * (
            model.attention_flops_per_token(1) * s.sample_mean_sq / 2)
    return flops


def trainer_min_chips(model: ModelSpec, hw: HardwareSpec, eff: Efficiency) -> int:
    """Chips whose memory holds weights, gradients and optimizer state (activations not
    counted)."""
    return math.ceil(model.total_params * eff.train_bytes_per_param / (0.9 * hw.hbm_bytes))


def trainer_model(model: ModelSpec, hw: HardwareSpec, workload: Workload, eff: Efficiency,
                  chips: int) -> TrainerModel:
    need = trainer_min_chips(model, hw, eff)
    if chips < need:
        raise Infeasible(f"trainer state of {model.name} needs >= {need} {hw.name} chips, "
                         f"got {chips}")
    return TrainerModel(model, hw, workload, eff, chips)


def weight_sync_s(model: ModelSpec, hw: HardwareSpec, eff: Efficiency, trainer_chips: int,
                  gen_replica_chips: int, total_chips: int) -> float:
    nbytes = model.total_params * eff.gen_bytes_per_param
    lanes = min(trainer_chips, gen_replica_chips)
    return nbytes / (lanes * hw.link_bw(total_chips) * eff.sync_bw_eff) + eff.sync_latency_s


@dataclasses.dataclass(frozen=True)
class ModeRates:
    mode: str
    step_s: float
    consumed_per_s: float
    trainer_idle: float     # waiting for a batch (the controller's pipeline/trainer_idle_frac)
    generator_idle: float
    train_frac: float       # computing train steps: MFU = busy MFU * train_frac
    staleness_bound: int | None  # None: per token (inflight)


def pipeline_rates(mode: str, batch: int, trainer_sps: float, gen_sps: float, *,
                   sync_s: float = 0.0, gen_batch_s: float | None = None,
                   zero_variance_frac: float = 0.0, sandbox_latency_s: float = 0.0,
                   staleness: int = 1) -> ModeRates:
    """Step time and idle fractions of one pipeline mode (equations in the module docstring).

    `gen_sps` is the generator's free-running rate; `gen_batch_s` the time to generate one
    batch behind a barrier (default: the batch at `gen_sps`, i.e. no tail)."""
    check_mode(mode)
    if min(trainer_sps, gen_sps) <= 0 or batch < 1:
        raise ValueError(f"need positive rates and batch, got trainer={trainer_sps} "
                         f"generator={gen_sps} batch={batch}")
    work = batch / (1 - zero_variance_frac) / gen_sps
    train = batch / trainer_sps
    if mode == "inflight":
        step, busy, bound = max(work, train + sync_s), work, None
    else:
        busy = work if gen_batch_s is None else max(gen_batch_s, 0.0)
        ahead = lead_for(check_mode(mode), staleness)
        cycle = busy + sandbox_latency_s + train + sync_s
        step, bound = max(busy, train + sync_s, cycle / (ahead + 1)), ahead
    return ModeRates(mode, step, batch / step, max(0.0, 1 - (train + sync_s) / step),
                     max(0.0, 1 - busy / step), train / step, bound)


@dataclasses.dataclass(frozen=True)
class Prediction:
    """All analytic outputs for one split of chips."""

    trainer: TrainerModel
    generator: GeneratorModel
    weight_sync_s: float
    sandbox_cores: float
    modes: dict[str, ModeRates]

    def mfu(self, mode: str) -> float:
        return self.trainer.eff.trainer_mfu * self.modes[check_mode(mode)].train_frac


def sandbox_cores(workload: Workload, samples_per_s: float, eff: Efficiency) -> float:
    """CPU cores for the tool calls and the rewards of `samples_per_s` (Little's law), at the
    target utilization: samples/s x ((turns - 1) x tool latency + reward s) / utilization."""
    return samples_per_s * workload.sandbox_s_per_sample / eff.sandbox_utilization


def predict(model: ModelSpec, hw: HardwareSpec, workload: Workload, eff: Efficiency,
            trainer_chips: int, generator_chips: int, *, staleness: int = 1) -> Prediction:
    """Rates of every pipeline mode for `trainer_chips` + `generator_chips` (raises Infeasible)."""
    tr = trainer_model(model, hw, workload, eff, trainer_chips)
    gen = generator_model(model, hw, workload, eff, generator_chips)
    sync = weight_sync_s(model, hw, eff, trainer_chips, gen.replica_chips,
                         trainer_chips + generator_chips)
    n_gen = workload.batch_size / (1 - workload.zero_variance_frac)
    barrier = gen.batch_s(n_gen)
    # Inflight keeps up to (1 + k) batches issued and not consumed; on average half a batch of
    # them waits in the buffer for the trainer, so about (k + 1/2) batches are being generated.
    # A sample's tool calls and reward lie on its path (Q below): an episode waits for each
    # tool, though its slot serves other sequences meanwhile.
    inflight_sps = gen.bounded_rate((0.5 + max(staleness, 1)) * n_gen,
                                    workload.sandbox_s_per_sample)
    modes = {
        m: pipeline_rates(m, workload.batch_size, tr.samples_per_s,
                          inflight_sps if m == "inflight" else n_gen / barrier, sync_s=sync,
                          gen_batch_s=barrier, zero_variance_frac=workload.zero_variance_frac,
                          sandbox_latency_s=workload.sandbox_s_per_sample, staleness=staleness)
        for m in MODES
    }
    return Prediction(tr, gen, sync, sandbox_cores(workload, gen.samples_per_s, eff), modes)
