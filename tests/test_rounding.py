"""The shared rounding rules against hand-derived values, and the callers that use them."""

import pytest

from jaxrl.rounding import kv_cache_len, next_power_of_two, round_up


@pytest.mark.parametrize(("n", "minimum", "want"), [
    (0, 1, 1), (1, 1, 1), (2, 1, 2), (3, 1, 4), (5, 1, 8), (8, 1, 8), (9, 1, 16),
    (1000, 1, 1024), (1024, 1, 1024), (1025, 1, 2048),
    (1, 16, 16), (15, 16, 16), (16, 16, 16), (17, 16, 32), (40, 16, 64), (100, 16, 128),
    (2.5, 1, 4), (4.0, 1, 4), (4.001, 1, 8), (0.3, 1, 1),
])
def test_next_power_of_two(n, minimum, want):
    assert next_power_of_two(n, minimum=minimum) == want


@pytest.mark.parametrize("minimum", [0, 3, 12, -4])
def test_next_power_of_two_rejects_a_bad_minimum(minimum):
    with pytest.raises(ValueError, match=f"power of two >= 1, got {minimum}"):
        next_power_of_two(5, minimum=minimum)


@pytest.mark.parametrize(("n", "multiple", "want"), [
    (0, 4, 0), (1, 4, 4), (4, 4, 4), (5, 4, 8), (10, 4, 12), (12, 4, 12), (7, 1, 7),
    (64, 3, 66), (16, 5, 20),
])
def test_round_up(n, multiple, want):
    assert round_up(n, multiple) == want


def test_round_up_rejects_a_bad_multiple():
    with pytest.raises(ValueError, match="multiple must be >= 1, got 0"):
        round_up(5, 0)


@pytest.mark.parametrize(("positions", "page", "want"), [
    (132, 16, 144), (128, 16, 128), (129, 16, 144), (5, 16, 16), (0, 16, 16), (132, 64, 192),
    (100, 24, 144), (100, 8, 112),
])
def test_kv_cache_len(positions, page, want):
    """Multiples of lcm(16, page): lcm(16, 24) = 48, so 100 -> 144; lcm(16, 8) = 16."""
    assert kv_cache_len(positions, page) == want


def test_planner_replica_chips_is_the_smallest_power_of_two_holding_the_weights_twice():
    """7e9 params x 2 bytes = 14e9 B of weights need 28e9 B of usable memory. 16e9 B chips at
    kv_mem_frac 0.5 (8e9 usable each): 28 / 8 = 3.5 chips -> 4. At 0.875 (14e9 usable): exactly 2
    chips -> 2 (holding them exactly is enough). At 0.25 (4e9): 7 -> 8."""
    import dataclasses

    from jaxrl.planner.analytic import replica_chips
    from jaxrl.planner.hardware import HardwareSpec
    from jaxrl.planner.specs import Efficiency, ModelSpec

    model = ModelSpec(name="m", total_params=7e9, active_params=7e9, layers=32, hidden=4096,
                      heads=32, kv_heads=8, head_dim=128, vocab=32000)
    hw = HardwareSpec("chip", 1e15, 16e9, 1e12, 1e11, 1e10, 8, "test")
    eff = Efficiency(gen_bytes_per_param=2.0, kv_mem_frac=0.5)
    assert replica_chips(model, hw, eff) == 4
    assert replica_chips(model, hw, dataclasses.replace(eff, kv_mem_frac=0.875)) == 2
    assert replica_chips(model, hw, dataclasses.replace(eff, kv_mem_frac=0.25)) == 8
    assert replica_chips(model, hw, dataclasses.replace(eff, gen_replica_chips=3)) == 3
