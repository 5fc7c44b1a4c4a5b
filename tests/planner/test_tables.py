"""The planner's data tables (jaxrl/planner/data/*.toml): sources, dates, values, errors.

The spot checks are the figures the code held as constants before the tables became files; a
failure means a row changed. Update the literal only when the new figure has its own source and
date in the row.
"""

import datetime
import json
import re

import pytest

from jaxrl.planner import cost, hardware, tables

BAD_ROW = """
[h100]
peak_flops = 989e12
hbm_bytes = 80e9
hbm_bw = 3.35e12
ici_bw = 450e9
dcn_bw = 50e9
chips_per_node = 8
date = 2026-11-29
source = "datasheet"
"""


def _rows():
    sheet = cost.PRICE_SHEET
    yield from ((f"hardware {k}", {"source": v.source, "date": v.date})
                for k, v in hardware.HARDWARE.items())
    yield from ((f"chips.{k}", v) for k, v in sheet["chips"].items())
    yield from ((f"hosted.{k}", v) for k, v in sheet["hosted"].items())
    yield "cpu_core", sheet["cpu_core"]


def test_every_row_has_a_source_and_an_iso_date():
    rows = dict(_rows())
    assert len(rows) == 11 + 5 + 2 + 1
    for name, row in rows.items():
        assert row["source"].strip(), name
        assert re.fullmatch(r"\d{4}-\d{2}-\d{2}", row["date"]), name
        datetime.date.fromisoformat(row["date"])


def test_values_equal_the_former_constants():
    h100, tpu7x, trn2 = (hardware.HARDWARE[k] for k in ("h100", "tpu7x", "trn2"))
    assert (h100.peak_flops, h100.hbm_bytes, h100.hbm_bw, h100.ici_bw, h100.dcn_bw,
            h100.chips_per_node) == (989e12, 80e9, 3.35e12, 450e9, 400e9 / 8, 8)
    assert tpu7x.hbm_bytes == 192 * 2**30 and tpu7x.ici_bw == 1200e9 / 2
    assert trn2.hbm_bytes == 96 * 2**30 and trn2.chips_per_node == 16
    assert hardware.HARDWARE["tpu-v5e"].ici_bw == 1600e9 / 8
    assert hardware.HARDWARE["gaudi3"].dcn_bw == 200e9 / 8
    assert hardware.HARDWARE["mi300x"].peak_flops == 1307.4e12
    assert list(hardware.HARDWARE)[:3] == ["h100", "h200", "b200"]
    sheet = cost.PRICE_SHEET
    assert [sheet["chips"][k]["usd_per_hour"] for k in ("h100", "h200", "b200", "mi300x",
                                                        "mi325x")] == [7.0, 7.0, 10.0, 1.85, 2.25]
    assert sheet["cpu_core"]["usd_per_hour"] == 0.0408
    inkling = sheet["hosted"]["tinker-inkling"]
    assert (inkling["prefill"], inkling["sample"], inkling["train"]) == (1.87, 4.68, 5.61)
    assert sheet["chips"]["mi300x"]["date"] == "2025-01-01"


@pytest.mark.parametrize("edit, message", [
    (("peak_flops = 989e12", 'peak_flops = "989 TFLOP/s"'),
     r"row h100: field 'peak_flops': expected float, got '989 TFLOP/s'"),
    (("chips_per_node = 8", "chips_per_node = 8.0"), r"row h100: field 'chips_per_node'"),
    (('source = "datasheet"', 'source = " "'), r"row h100: field 'source': empty"),
    (('source = "datasheet"', ""), r"row h100: field 'source' is missing"),
    (("date = 2026-11-29", 'date = "Nov 2026"'), r"row h100: field 'date': expected an ISO"),
    (("date = 2026-11-29", "date = 2026-11-29\nhbm = 1"), r"row h100: field 'hbm': unknown"),
    (("peak_flops = 989e12", "peak_flops = 0"), r"row h100: peak_flops must be > 0"),
    (("[h100]", "[h100"), r"not valid TOML.*line 2"),
])
def test_a_malformed_hardware_file_names_file_row_and_field(tmp_path, edit, message):
    path = tmp_path / "hw.toml"
    path.write_text(BAD_ROW.replace(*edit))
    with pytest.raises(ValueError, match=r"hw\.toml: .*" + message):
        hardware.load_hardware(path)
    path.write_text(BAD_ROW)
    assert hardware.load_hardware(path)["h100"] == hardware.HardwareSpec(
        "h100", 989e12, 80e9, 3.35e12, 450e9, 50e9, 8, "datasheet", "2026-11-29")


def test_a_malformed_price_row_names_file_row_and_field(tmp_path):
    path = tmp_path / "prices.toml"
    path.write_text('[cpu_core]\nusd_per_hour = 0.04\nsource = "x"\ndate = 2026-06-17\n'
                    '[chips.h100]\nusd_per_hour = "7"\nsource = "x"\ndate = 2026-12-01\n')
    with pytest.raises(ValueError, match=r"prices\.toml: row chips\.h100: field 'usd_per_hour'"):
        cost.check_sheet(tables.read(path), path)
    path.write_text(json.dumps({"chips": {"trn2": {"usd_per_hour": 2.5, "source": "mine",
                                                   "date": "read in December"}}}))
    with pytest.raises(ValueError, match=r"row chips\.trn2: field 'date': expected an ISO"):
        cost.load_prices(str(path))
    path.write_text(json.dumps({"gpus": {}}))
    with pytest.raises(ValueError, match=r"unknown sections \['gpus'\]"):
        cost.load_prices(str(path))
