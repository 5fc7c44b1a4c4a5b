"""The published case the planner must reproduce.

Source: SemiAnalysis, "RL Systems Mind the Gap: Matching Trainer and Generator Throughput"
(Kimbo Chen, Cheang Kang Wen, Dylan Patel; 16 June 2026). Its figures: a trainer able to
consume 2.75 samples/s, fed by a generator producing 1.95 samples/s, waited ~30% of wall-clock
and ran at 10.5% MFU, on 256 H200s. jaxrl's issue describes the run as GLM-5 on 128 trainer + 128
generator H200s; a third-party summary of the same report (druckfin.com, 16 June 2026) attributes
the figures to Qwen3-235B(-Thinking) on 64 trainer + 192 generator H200s. Both are reproduced.

What is derived here (not published): the sample length each description implies. Over
wall-clock the trainer consumes what the generator produces, so
    MFU = consumed/s * 6 * N_active * T / (trainer_chips * peak)
    =>  T = MFU * trainer_chips * peak / (consumed/s * 6 * N_active),
counting 6 N_active T per sample (no attention term, no extra log-prob passes).
"""

from __future__ import annotations

import dataclasses

from jaxrl.planner.analytic import pipeline_rates, trainer_flops_per_sample
from jaxrl.planner.hardware import HardwareSpec, get_hardware
from jaxrl.planner.measured import MeasuredRates, from_measured
from jaxrl.planner.recommend import Recommendation
from jaxrl.planner.specs import Workload, get_model

SOURCE = ("SemiAnalysis, 'RL Systems Mind the Gap: Matching Trainer and Generator Throughput' "
          "(K. Chen, C. K. Wen, D. Patel, 2026-06-16)")
TRAINER_CAPACITY = 2.75  # samples/s the trainer could consume
GENERATOR_RATE = 1.95    # samples/s the generator produced
PUBLISHED_MFU = 0.105
PUBLISHED_IDLE = (0.29, 0.30)
ROUND_TOKENS = 100       # the stated sample length is rounded to this


@dataclasses.dataclass(frozen=True)
class PublishedCase:
    label: str
    model: str  # preset name in jaxrl.planner.specs.MODELS
    trainer_chips: int
    generator_chips: int
    attribution: str


CASES: tuple[PublishedCase, ...] = (
    PublishedCase("glm-5 128+128", "glm-5", 128, 128, "as described in jaxrl issue 10"),
    PublishedCase("qwen3-235b 64+192", "qwen3-235b-a22b", 64, 192,
                  "third-party summary (druckfin.com, 2026-06-16)"),
)


@dataclasses.dataclass(frozen=True)
class Reproduction:
    case: PublishedCase
    trainer_idle: float           # predicted, overlapped pipeline
    implied_tokens_exact: float   # sample length (prompt + response) implied by 10.5% MFU
    sample_tokens: int            # the same, rounded: the length we state
    predicted_mfu: float          # MFU the planner predicts with `sample_tokens`
    busy_mfu: float               # MFU while the trainer computes
    matched: Recommendation       # rate-matched split, whole 8-GPU nodes
    matched_exact: Recommendation  # rate-matched split, any chip count

    @property
    def mfu_rel_err(self) -> float:
        return abs(self.predicted_mfu / PUBLISHED_MFU - 1)


def implied_sample_tokens(active_params: float, trainer_chips: int, hw: HardwareSpec,
                          mfu: float = PUBLISHED_MFU, consumed_per_s: float = GENERATOR_RATE
                          ) -> float:
    return mfu * trainer_chips * hw.peak_flops / (consumed_per_s * 6 * active_params)


def reproduce(case: PublishedCase, hw: HardwareSpec | None = None) -> Reproduction:
    hw = hw or get_hardware("h200")
    model = get_model(case.model)
    rates = MeasuredRates(case.trainer_chips, case.generator_chips,
                          trainer_rate=TRAINER_CAPACITY, generator_rate=GENERATOR_RATE,
                          mode="async")
    # The planner's own path: capacities -> overlapped pipeline -> idle fraction.
    idle = pipeline_rates("async", 1, rates.trainer_rate, rates.generator_rate).trainer_idle
    exact = implied_sample_tokens(model.active_params, case.trainer_chips, hw)
    tokens = int(round(exact / ROUND_TOKENS) * ROUND_TOKENS)
    # A fixed-length workload of `tokens` tokens, counted as 6 N_active T (no extra passes).
    w = Workload(prompt_len=1, response_mean=tokens - 1, response_sigma=0.0,
                 response_max=tokens - 1, group_size=1, batch_size=1, logprob_passes=0)
    flops = trainer_flops_per_sample(model, w, attention=False)
    busy = TRAINER_CAPACITY * flops / (case.trainer_chips * hw.peak_flops)
    total = case.trainer_chips + case.generator_chips
    return Reproduction(
        case, idle, exact, tokens, busy * (1 - idle), busy,
        matched=from_measured(rates, total_chips=total, granularity=hw.chips_per_node),
        matched_exact=from_measured(rates, total_chips=total, granularity=1))


def report(hw: HardwareSpec | None = None) -> str:
    lines = [f"Published case: {SOURCE}",
             f"trainer capacity {TRAINER_CAPACITY} samples/s, generator {GENERATOR_RATE} "
             f"samples/s, published MFU {PUBLISHED_MFU:.1%}, idle ~30%"]
    for case in CASES:
        r = reproduce(case, hw)
        m, x = r.matched, r.matched_exact
        lines += [
            f"- {case.label} H200 ({case.attribution}):",
            f"    predicted trainer idle {r.trainer_idle:.1%}; implied sample length "
            f"{r.implied_tokens_exact:,.0f} tokens, stated {r.sample_tokens:,} -> predicted MFU "
            f"{r.predicted_mfu:.2%} ({r.mfu_rel_err:.1%} off 10.5%); busy MFU {r.busy_mfu:.1%}",
            f"    rate-matched split (8-GPU nodes) {m.best.split}: "
            f"{m.best.rates.consumed_per_s:.3f} samples/s, +{m.gain:.1%} over {case.label}; "
            f"any chip count {x.best.split}: {x.best.rates.consumed_per_s:.3f} samples/s, "
            f"+{x.gain:.1%}",
        ]
    return "\n".join(lines)


if __name__ == "__main__":
    print(report())
