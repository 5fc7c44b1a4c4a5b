"""A run whose prompts would run out says so before any work (it used to evaluate for minutes and
then die with a bare StopIteration from grain)."""

import json
import time

import pytest
from run_helpers import tiny_run_config

import jaxrl.run
from jaxrl.config import ConfigError
from jaxrl.data.pipeline import PromptIterator


def _gsm8k_file(path, n=8):
    with open(path, "w") as f:
        for i in range(n):
            f.write(json.dumps({"question": f"Ann has {i} pens and gets 2. How many now?",
                                "answer": f"{i} + 2 = {i + 2}\n#### {i + 2}"}) + "\n")
    return path


def test_batches_left_counts_whole_batches():
    it = PromptIterator([{"uid": str(i)} for i in range(10)], prompts_per_step=4, epochs=2)
    assert it.batches_left() == 5
    next(it)
    assert it.batches_left() == 4
    assert PromptIterator([{"uid": "a"}], prompts_per_step=1, epochs=0).batches_left() is None


def test_exhausting_the_data_fails_before_any_work(tmp_path):
    data = dict(task="gsm8k_jsonl", paths=(str(_gsm8k_file(tmp_path / "g.jsonl")),),
                eval_size=2, prompts_per_step=4, epochs=1)
    cfg = tiny_run_config(tmp_path, data=data, pipeline=dict(steps=3))
    t0 = time.perf_counter()
    with pytest.raises(ConfigError, match=r"the data runs out: 6 training prompts .* make 1 "
                                          r"steps per epoch.*--data.epochs=2 or more"):
        jaxrl.run.run(cfg, progress=False)
    assert time.perf_counter() - t0 < 60  # no SFT, no evaluation, no compilation of the step
    assert not (tmp_path / "runs" / "t" / "checkpoints").exists()
