"""The planner's pipeline equations against jaxrl's real controller (jaxrl.rl.loop).

Produce, train and publish are sleeps of known length (G, X, S), so the controller's measured
step times, idle fractions and rates can be checked against `analytic.pipeline_rates` in every
mode, and its metrics rows fed back through `from_measured` (closing the loop). This calibrates
the mode equations; calibrating the model's FLOP/byte costs needs the default experiment
(docs/planner.md, "Calibration").
"""

import statistics
import time

import pytest
from fake_loop import batch, fake_loop

from jaxrl.planner.analytic import MODES, pipeline_rates
from jaxrl.planner.measured import from_measured

# Long enough that a few milliseconds of scheduler jitter on a loaded CI machine (sleep overshoot,
# the GIL) stay well inside the tolerances: at G = 80 ms one CI run read 0.20 idle for 0.31.
G, X, S, B = 0.24, 0.12, 0.045, 8


def run_controller(mode, steps=8):
    def produce(step, weights):
        _, version = weights()
        t = time.perf_counter()
        time.sleep(G)
        return batch(step, version, num_rollouts=B, busy_s=time.perf_counter() - t)

    def train(step, produced):
        time.sleep(X)
        return {}, step

    def publish(params, version):
        time.sleep(S)
        return params, {"pipeline/weight_sync_s": S}

    rows = []
    loop = fake_loop(mode, max_staleness=1, produce=produce, train=train, publish=publish,
                     initial_params=0, poll_s=0.002, rows=rows)
    loop.run(start_step=0, num_steps=steps)
    return rows[2:]  # skip the pipeline fill


@pytest.mark.parametrize("mode", MODES)
def test_controller_matches_mode_equations(mode):
    rows = run_controller(mode)
    measured_step = statistics.median(r["pipeline/step_s"] for r in rows)
    predicted = pipeline_rates(mode, B, B / X, B / G, sync_s=S)
    assert measured_step == pytest.approx(predicted.step_s, rel=0.2)
    idle = statistics.median(r["pipeline/trainer_idle_frac"] for r in rows)
    assert idle == pytest.approx(predicted.trainer_idle, abs=0.1)
    # The controller's rates are per second of busy time: trainer B / (X + S), generator B / G.
    consumed = statistics.median(r["pipeline/rollouts_per_s_consumed"] for r in rows)
    produced = statistics.median(r["pipeline/rollouts_per_s_produced"] for r in rows)
    assert consumed == pytest.approx(B / (X + S), rel=0.2)
    assert produced == pytest.approx(B / G, rel=0.2)


def test_controller_metrics_feed_back_into_the_planner():
    rows = run_controller("periodic")
    metrics = {k: statistics.median(r[k] for r in rows)
               for k in ("pipeline/rollouts_per_s_consumed", "pipeline/rollouts_per_s_produced",
                         "pipeline/trainer_idle_frac", "pipeline/trainer_busy_s")}
    rec = from_measured({**metrics, "pipeline/mode": "periodic"}, trainer_chips=4,
                        generator_chips=4)
    assert rec.baseline.rates.trainer_idle == pytest.approx(
        metrics["pipeline/trainer_idle_frac"], abs=0.1)
    # The trainer (B / 165 ms) outpaces the generator (B / 240 ms): move chips to the generator.
    assert rec.best.generator_chips > 4 and rec.gain > 0
