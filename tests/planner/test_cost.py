"""The cost view (jaxrl/planner/cost.py): arithmetic by hand, the price sheet's sources."""

import json

import pytest

from jaxrl.planner import cost as costs
from jaxrl.planner.analytic import ModeRates
from jaxrl.planner.cli import main
from jaxrl.planner.hardware import HARDWARE
from jaxrl.planner.recommend import SplitResult


def test_plan_cost_by_hand():
    # 2 + 6 chips at $3/h, 4 sandbox cores at $0.5/h, 2 rollouts/s, 10 s steps.
    c = costs.plan_cost(2, 6, 2.0, 10.0, 4.0, chip_usd_h=3.0, core_usd_h=0.5)
    assert c.usd_per_hour == pytest.approx(2 * 3 + 6 * 3 + 4 * 0.5)            # $26/h
    assert c.usd_per_million == pytest.approx(26 / (3600 * 2) * 1e6)           # $3,611.11
    assert c.usd_per_step == pytest.approx(26 * 10 / 3600)                     # $0.0722
    assert c.split() == pytest.approx({"trainer": 6 / 26, "generator": 18 / 26,
                                       "sandbox": 2 / 26})


def _split(t, g, rate):
    return SplitResult(t, g, ModeRates("async", 8 / rate, rate, 0.0, 0.0, 1.0, 1))


def test_split_cost_sandbox_cores_and_cheapest():
    # 1 s of sandbox per rollout at 50% utilization: 2 cores per rollout/s.
    c = costs.split_cost(_split(1, 1, 4.0), 1.0, 0.25, sandbox_s_per_rollout=1.0,
                         sandbox_utilization=0.5)
    assert c.sandbox_usd_h == pytest.approx(8 * 0.25)
    assert c.step_s == pytest.approx(2.0)
    fast_dear, slow_cheap = _split(4, 4, 4.0), _split(1, 1, 2.0)  # $8/h at 4/s, $2/h at 2/s

    def cost_of(r):
        return costs.split_cost(r, 1.0, 0.0, 0.0, 1.0)

    assert costs.cheapest([fast_dear, slow_cheap], cost_of) is slow_cheap


def test_hosted_by_hand():
    entry = {"prefill": 1.0, "sample": 2.0, "train": 3.0}
    # one rollout: 100 prompt + 400 response tokens, 2 epochs of training on all 500
    per_rollout = (100 * 1.0 + 400 * 2.0 + 2 * 500 * 3.0) / 1e6
    assert costs.hosted_usd_per_million(entry, 100, 400, epochs=2) == pytest.approx(
        per_rollout * 1e6)


def test_every_price_has_a_source_and_date():
    sheet = costs.load_prices()
    costs.check_sheet(sheet)
    for name, e in [*sheet["chips"].items(), *sheet["hosted"].items(),
                    ("cpu_core", sheet["cpu_core"])]:
        assert "http" in e["source"] and e["date"], name
    assert set(sheet["chips"]) <= set(HARDWARE)


def test_new_hardware_has_sources():
    for name in ("mi300x", "mi325x", "gaudi3", "trn2", "tpu7x"):
        assert "http" in HARDWARE[name].source and "2026-12-01" in HARDWARE[name].source


def test_user_file_overrides_and_missing_price(tmp_path):
    path = tmp_path / "p.json"
    path.write_text(json.dumps({"chips": {"trn2": {"usd_per_hour": 2.5, "source": "mine",
                                                   "date": "2026-12-01"}}}))
    sheet = costs.load_prices(str(path))
    assert costs.chip_price(sheet, "trn2") == 2.5
    assert costs.chip_price(sheet, "h200") == costs.load_prices()["chips"]["h200"][
        "usd_per_hour"]
    with pytest.raises(ValueError, match="no on-demand price for 'trn2'"):
        costs.chip_price(costs.load_prices(), "trn2")
    path.write_text(json.dumps({"chips": {"x": {"usd_per_hour": 1.0}}}))
    with pytest.raises(ValueError, match="source"):
        costs.load_prices(str(path))


def test_cli_cost_published_case(capsys):
    assert main(["--cost"]) == 0
    out = capsys.readouterr().out
    per_m = 256 * costs.load_prices()["chips"]["h200"]["usd_per_hour"] / (3600 * 1.95) * 1e6
    assert f"published      128:128: ${per_m:,.0f} per 1M rollouts" in out
    assert "recommended    104:152" in out and "hosted API tinker-inkling" in out


def test_cli_cost_objective_on_a_small_plan(capsys):
    assert main(["--model", "qwen3-8b", "--hardware", "h200", "--chips", "16", "--split",
                 "8:8", "--cost", "--objective", "cost"]) == 0
    out = capsys.readouterr().out
    assert "cheapest" in out and "per 1M rollouts" in out
    assert main(["--model", "qwen3-8b", "--hardware", "gaudi3", "--chips", "16",
                 "--cost"]) == 2
