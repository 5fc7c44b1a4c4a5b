"""Solve-rate tracking and zero-variance filtering."""

from __future__ import annotations

import json

import numpy as np

from jaxrl.data.solve_rate import SolveRateTracker, zero_variance_mask


def test_zero_variance_mask():
    r = [[1, 1, 1], [0, 0, 0], [0, 1, 0], [0.5, 0.5, 0.5 + 1e-9]]
    assert zero_variance_mask(r).tolist() == [True, True, False, True]


def test_update_groups_returns_groups_with_variance_and_tracks_rates():
    t = SolveRateTracker(min_samples=4, skip_solved=True, skip_unsolved=True)
    keep = t.update_groups(["a", "b", "c"], np.array([[1, 1], [0, 1], [0, 0]], np.float32))
    assert keep.tolist() == [False, True, False]
    assert t.solve_rate("a") == 1.0 and t.solve_rate("b") == 0.5 and t.solve_rate("c") == 0.0
    assert t.solve_rate("zzz") is None
    # below min_samples nothing is skipped yet
    assert not any(t.should_skip(u) for u in "abc")
    t.update_groups(["a", "b", "c"], [[1, 1], [1, 1], [0, 0]])
    assert t.should_skip("a") and t.should_skip("c") and not t.should_skip("b")
    m = t.metrics()
    assert m["data/always_solved_frac"] == 1 / 3 and m["data/never_solved_frac"] == 1 / 3
    assert m["data/zero_variance_group_frac_total"] == 5 / 6


def test_skip_flags_are_independent():
    t = SolveRateTracker(min_samples=1, skip_solved=True, skip_unsolved=False)
    t.update("s", [1.0])
    t.update("u", [0.0])
    assert t.should_skip("s") and not t.should_skip("u")


def test_state_round_trips_through_json():
    t = SolveRateTracker(min_samples=2, skip_solved=True)
    t.update_groups(["a", "b"], [[1, 1], [0, 1]])
    u = SolveRateTracker(min_samples=2, skip_solved=True)
    u.set_state(json.loads(json.dumps(t.get_state())))
    assert u.get_state() == t.get_state() and u.should_skip("a")
