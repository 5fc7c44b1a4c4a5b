"""pass@k maths against hand-computed values."""

from __future__ import annotations

import math

import pytest

from jaxrl.data.config import DataConfig
from jaxrl.data.evaluate import pass_at_k, pass_at_k_metrics, should_evaluate


def test_pass_at_k_hand_computed():
    # n=5, c=2, k=2: 1 - C(3,2)/C(5,2) = 1 - 3/10
    assert pass_at_k(5, 2, 2) == pytest.approx(0.7)
    assert pass_at_k(5, 2, 1) == pytest.approx(0.4)  # = c / n
    assert pass_at_k(4, 0, 4) == 0.0
    assert pass_at_k(4, 1, 4) == 1.0  # n - c < k
    assert pass_at_k(10, 3, 5) == pytest.approx(1 - math.comb(7, 5) / math.comb(10, 5))
    with pytest.raises(ValueError, match="k=5"):
        pass_at_k(4, 1, 5)


def test_pass_at_k_metrics_means_over_prompts():
    correct = [[1, 0, 0, 0], [1, 1, 0, 0], [0, 0, 0, 0]]
    m = pass_at_k_metrics(correct, (1, 2, 4))
    # pass@1 = mean(1/4, 2/4, 0); pass@2 = mean(1 - C(3,2)/C(4,2), 1 - C(2,2)/C(4,2), 0)
    assert m["eval/pass@1"] == pytest.approx((0.25 + 0.5 + 0) / 3)
    assert m["eval/pass@2"] == pytest.approx((0.5 + 5 / 6 + 0) / 3)
    assert m["eval/pass@4"] == pytest.approx(2 / 3)


def test_should_evaluate_interval_and_end():
    cfg = DataConfig(eval_every=5)
    assert [s for s in range(12) if should_evaluate(s, cfg)] == [5, 10]
    assert should_evaluate(3, DataConfig(eval_every=0), final=True)
    assert not should_evaluate(3, DataConfig(eval_every=0))
