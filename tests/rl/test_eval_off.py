"""`--data.eval=false` turns held-out evaluation off from a config, as run(evaluate=False) does."""

from run_helpers import tiny_run_config

import jaxrl.run
from jaxrl.config import apply_overrides
from jaxrl.rl.evaluator import Evaluator
from jaxrl.rl.metrics import read_metrics


def test_data_eval_false_runs_no_evaluation(tmp_path, monkeypatch):
    def no_eval(self, step, **kw):
        raise AssertionError(f"evaluated at step {step} with data.eval=false")

    monkeypatch.setattr(Evaluator, "__call__", no_eval)
    cfg = apply_overrides(tiny_run_config(tmp_path),
                          ["--data.eval=false", "--data.eval_every=1", "--pipeline.steps=2"])
    result = jaxrl.run.run(cfg, progress=False)  # evaluate=True (the default) is not enough
    assert result.eval_start == {} and result.eval_end == {}
    rows = read_metrics(result.run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    assert not [k for r in rows for k in r if k.startswith("eval/")]
