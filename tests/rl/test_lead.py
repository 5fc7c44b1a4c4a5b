"""Adaptive staleness (`pipeline.lead=auto`): the lead rule on synthetic logprobs and drift
sequences, and the pipeline following it when the learning rate is raised mid-run."""

import numpy as np
import pytest
from fake_loop import batch, fake_loop

from jaxrl.config import ConfigError
from jaxrl.config.sections import PipelineConfig
from jaxrl.rl.lead import LeadRule
from jaxrl.train import algorithms as A


def _m2(sigma_per_version: float, staleness: int, seed: int = 0) -> float:
    """M2 of a synthetic batch: behaviour logprobs mu, the trainer's pi = mu + a random walk of
    `staleness` steps of size sigma (the policy moved that many updates since sampling)."""
    rng = np.random.default_rng(seed)
    mu_BT = np.log(rng.uniform(0.05, 1.0, (16, 32))).astype(np.float32)
    steps_SBT = rng.normal(0.0, sigma_per_version, (max(staleness, 1), 16, 32))
    pi_BT = (mu_BT + (steps_SBT.sum(0) if staleness else 0.0)).astype(np.float32)
    mask_BT = np.ones((16, 32), np.float32)
    mask_BT[:, 24:] = 0.0  # padding: ignored
    pi_BT[:, 24:] = 99.0
    return float(A.log_ratio_m2(pi_BT, mu_BT, mask_BT))


def test_log_ratio_m2_is_the_masked_second_moment():
    mu = np.zeros((2, 3), np.float32)
    pi = np.array([[0.1, -0.2, 5.0], [0.3, 0.0, 5.0]], np.float32)
    mask = np.array([[1, 1, 0], [1, 1, 0]], np.float32)
    assert float(A.log_ratio_m2(pi, mu, mask)) == pytest.approx((0.01 + 0.04 + 0.09) / 4)


def test_rule_on_synthetic_logprobs_lowers_when_drift_grows_and_raises_when_small():
    rule = LeadRule(k_max=4, tau=0.04, patience=2)
    lead, leads = rule.lead, []
    # small drift (sigma 0.02 per version: M2 ~ 4e-4 per version): the lead stays at k_max
    for i in range(6):
        lead = rule.update(_m2(0.02, lead, seed=i), lead)
        leads.append(lead)
    assert leads == [4] * 6
    # the learning rate is raised: sigma 0.12 per version, M2 ~ 0.0144 per version -> lead 2
    for i in range(6):
        lead = rule.update(_m2(0.12, lead, seed=10 + i), lead)
        leads.append(lead)
    assert leads[7] < 4 and leads[-1] == 2, leads  # within two batches (smoothing)
    assert all(b <= a for a, b in zip(leads[5:], leads[6:], strict=False)), leads  # never raised
    # drift falls again: raised one version at a time, `patience` steps apart, back to k_max
    for i in range(20):
        lead = rule.update(_m2(0.01, lead, seed=30 + i), lead)
        leads.append(lead)
    assert leads[-1] == 4
    tail = leads[12:]
    changes = [i for i in range(1, len(tail)) if tail[i] != tail[i - 1]]
    assert all(tail[i] - tail[i - 1] == 1 for i in changes)
    assert all(b - a >= 2 for a, b in zip(changes, changes[1:], strict=False))
    assert rule.lead == 4


def test_rule_hysteresis_band_holds_the_lead():
    rule = LeadRule(k_max=3, tau=0.04, raise_frac=0.5, patience=1, smoothing=1.0, lead=2)
    # drift 0.015/version: M2(2) = 0.03 <= tau (no lowering), M2(3) = 0.045 >= tau/2 (no raise)
    assert [rule.update(0.015 * 2, 2) for _ in range(5)] == [2] * 5
    assert rule.update(0.025 * 2, 2) == 1  # M2(2) = 0.05 > tau: lowered
    assert rule.update(float("nan"), 1) == 1  # a skipped update changes nothing
    assert rule.update(0.005, 1) == 2  # M2(2) = 0.01 < tau/2: raised
    assert rule.update(0.5, 2) == 0  # a jump: down to the largest lead that fits, at once


def test_pipeline_lead_falls_when_the_learning_rate_is_raised():
    """async, k_max 3, fake generator/trainer: the trainer's M2 is lr^2 per version of staleness;
    the learning rate is raised at step 8. The chosen lead and the batches' staleness fall."""
    rule = LeadRule(k_max=3, tau=0.04, patience=2)
    rows, stale = [], {}

    def produce(step, weights):
        _, version = weights()
        return batch(step, version, num_rollouts=4, busy_s=0.01)

    def train(step, produced):
        s = step - produced.min_version
        stale[step] = s
        lr = 0.05 if step < 8 else 0.17
        rule.update(lr**2 * s, s)  # the measured M2 of this batch
        return {**rule.metrics()}, f"p{step + 1}"

    loop = fake_loop("async", max_staleness=3, produce=produce, train=train, initial_params="p0",
                     publish=lambda p, v: (p, {}), lead=lambda: rule.lead, rows=rows)
    loop.run(start_step=0, num_steps=20)
    lead = [r["staleness/lead"] for r in rows]
    assert lead[:8] == [3.0] * 8 and lead[-1] == 1.0, lead
    assert max(stale[s] for s in range(14, 20)) <= 1, stale  # the generator follows the lead


def test_config_lead_auto_needs_a_mode_with_a_lead():
    assert PipelineConfig(mode="async", lead="auto").lead == "auto"
    with pytest.raises(ConfigError, match="lead"):
        PipelineConfig(mode="periodic", lead="auto")
    with pytest.raises(ConfigError, match="lead_tau"):
        PipelineConfig(mode="async", lead="auto", lead_tau=0.0)
