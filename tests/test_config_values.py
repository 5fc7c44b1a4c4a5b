"""Bad values fail before any work: non-finite floats, run names that leave run_dir, bad bytes in
data files (each used to be accepted or end in a bare traceback)."""

import math

import pytest

from jaxrl.config import ConfigError, RunConfig, apply_overrides
from jaxrl.data.sources import RecordError, load_records


@pytest.mark.parametrize("override", ["--train.lr=inf", "--generate.temperature=nan",
                                      "--rewards.timeout_s=nan", "--rewards.timeout_s=inf",
                                      "--train.eps_high=-inf"])
def test_non_finite_floats_are_rejected(override):
    with pytest.raises(ConfigError, match=r"is not valid; it must be a finite number|must be"):
        apply_overrides(RunConfig(), [override])
    key = override[2:].split("=")[0]
    with pytest.raises(ConfigError, match=key.replace(".", r"\.")):
        apply_overrides(RunConfig(), [override])
    assert math.isfinite(RunConfig().train.lr)


@pytest.mark.parametrize("name", ["../../..", "a/b", "..", ".", ""])
def test_run_names_are_single_path_components(name):
    with pytest.raises(ConfigError, match="single path component"):
        apply_overrides(RunConfig(), [f"--name={name}"])


def test_a_bad_byte_names_file_and_line_and_can_be_skipped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b'{"prompt": "a"}\n{"prompt": "b\xff"}\n{"prompt": "c"}\n')
    with pytest.raises(RecordError, match=r"d.jsonl:2: not UTF-8 \(byte 0xff at column 14\)"):
        load_records([path])
    src = load_records([path], skip_bad_records=True)
    assert [r["prompt"] for r in src] == ["a", "c"] and src.bad_records == 1


def test_override_order_does_not_matter_for_checks_across_keys():
    """Cross-key checks run once every override is applied (`--pipeline.steps=2000` before
    `--train.total_steps=2000` with a cosine schedule used to fail on the first one)."""
    ovr = ["--train.schedule=cosine", "--pipeline.steps=2000", "--train.total_steps=2000"]
    assert apply_overrides(RunConfig(), ovr).train.total_steps == 2000
    cfg = apply_overrides(RunConfig(), ["--data.task=records", "--data.paths=a.jsonl"])
    assert cfg.data.task == "records"
    with pytest.raises(ConfigError, match="reads data.paths"):
        apply_overrides(RunConfig(), ["--data.task=records"])


def test_group_size_one_warns_naming_the_key():
    """One sample per group: GRPO-family advantages are all zero; a warning at config time
    (before: accepted silently)."""
    import warnings

    from jaxrl.config.base import ConfigWarning

    with pytest.warns(ConfigWarning, match=r"data\.group_size=1: every advantage is zero"):
        cfg = apply_overrides(RunConfig(), ["--data.group_size=1"])
    assert cfg.data.group_size == 1  # a warning, not an error
    with warnings.catch_warnings():
        warnings.simplefilter("error", ConfigWarning)
        apply_overrides(RunConfig(), ["--data.group_size=2"])
