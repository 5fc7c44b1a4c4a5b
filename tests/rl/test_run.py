"""End-to-end runs of the controller on a tiny model (simulated CPU devices)."""

import dataclasses
import json
import threading

import numpy as np
import pytest
from run_helpers import tiny_run_config
from tiny_multiturn_config import tiny_multiturn_run_config

import jaxrl.run
from jaxrl.config import ConfigError, MeshConfig
from jaxrl.rl import update
from jaxrl.rl.loop import lead_for
from jaxrl.rl.metrics import REQUIRED, read_metrics


def test_mesh_that_does_not_fit_fails_before_any_work(tmp_path):
    cfg = dataclasses.replace(tiny_run_config(tmp_path),
                              mesh=MeshConfig(trainer=(8, 1), generator=(8, 1)))
    with pytest.raises(ConfigError, match="8 device\\(s\\) available, 16 requested"):
        jaxrl.run.run(cfg, progress=False)
    assert not (tmp_path / "runs").exists()  # nothing was created


# The one pipeline-mode matrix of whole runs (the loop's modes are tested with fakes in
# test_pipeline_modes.py): each mode runs once, single-turn (sync, inflight: the per-chunk weight
# install of `_generate`) or with multi-turn episodes (periodic, async), and every check that a
# mode's run can show is made on that run.
MULTI_TURN = ("periodic", "async")
K = 2


@pytest.fixture(scope="module")
def mode_runs(tmp_path_factory):
    """mode -> (RunResult, [(trainer version, [token versions]) of every trained rollout])."""
    runs = {}
    for mode in ("sync", "periodic", "async", "inflight"):
        tmp = tmp_path_factory.mktemp(mode)
        pipe = dict(mode=mode, max_staleness=K)
        train = dict(correction="tis_token" if mode == "inflight" else "none")
        if mode in MULTI_TURN:
            cfg = tiny_multiturn_run_config(  # also: data.eval=false with eval_every=1
                tmp, name=mode, data=dict(prompts_per_step=2, group_size=2, eval=False,
                                          eval_every=1),
                pipeline=dict(pipe, steps=2), train=train)
        else:
            cfg = tiny_run_config(tmp, name=mode, pipeline=pipe, train=train)
        seen, real = [], update.staleness_stats

        def spy(groups, trainer_version, seen=seen, real=real):
            for r in (r for g in groups for r in g.rollouts):  # the model's tokens
                mask = r.mask if r.mask is not None else [1] * len(r.versions)
                seen.append((trainer_version,
                             [v for v, m in zip(r.versions, mask, strict=True) if m]))
            return real(groups, trainer_version)

        update.staleness_stats = spy
        try:
            runs[mode] = (jaxrl.run.run(cfg, progress=False), seen)
        finally:
            update.staleness_stats = real
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["sync", "periodic", "async", "inflight"])
def test_each_mode_completes_with_bounded_staleness(mode_runs, mode):
    result, seen = mode_runs[mode]
    rows = read_metrics(result.run_dir)
    assert [r["step"] for r in rows] == list(range(2 if mode in MULTI_TURN else 3))
    for row in rows:
        missing = [name for name in REQUIRED if name not in row]
        assert not missing, missing
        assert 0 <= row["staleness/max"] <= lead_for(mode, K)
        assert row["pipeline/mode"] == mode
    # staleness is counted on the model's tokens (of every turn): within the bound, and versions
    # never go back in time inside an episode (inflight may move them forward between turns)
    lags = [v - t for t, vs in seen for v in vs]
    assert lags and all(-lead_for(mode, K) <= lag <= 0 for lag in lags)
    assert all(vs == sorted(vs) for _, vs in seen)
    if mode in MULTI_TURN:
        for r in rows:
            assert r["env/turns_mean"] == 2.0
            assert r["generator/slots_waiting_on_tools"] == 0.0
        # --data.eval=false turns evaluation off (run(evaluate=True), the default, is not
        # enough to turn it on), even with eval_every=1
        assert result.eval_start == {} and result.eval_end == {}
        assert not [k for r in rows for k in r if k.startswith("eval/")]
    else:
        assert result.eval_start and result.eval_end
    if mode == "inflight":  # the correction consumed the behaviour logprobs of every token
        assert any(key.startswith("is/") for key in rows[-1])
    trace = json.loads((result.run_dir / "trace.json").read_text())
    names = {e.get("args", {}).get("name") for e in trace["traceEvents"] if e.get("ph") == "M"}
    assert {"trainer", "generator", "weight_sync", "sandbox"} <= names
    releases = [e for e in trace["traceEvents"] if e.get("name") == "release"]
    assert len(releases) == (3 if mode == "sync" else 0)  # generator memory freed per update


@pytest.mark.slow
def test_sync_mode_is_bit_reproducible(tmp_path, mode_runs):
    a = mode_runs["sync"][0]
    b = jaxrl.run.run(tiny_run_config(tmp_path, name="sync",
                                      pipeline=dict(mode="sync", max_staleness=K)),
                      progress=False)
    keys = ("loss/total", "reward/mean", "train/grad_norm", "staleness/max")
    rows_a, rows_b = read_metrics(a.run_dir), read_metrics(b.run_dir)
    for ra, rb in zip(rows_a, rows_b, strict=True):
        assert [ra[k] for k in keys] == [rb[k] for k in keys]
    pa = _final_params(a.run_dir)
    pb = _final_params(b.run_dir)
    for x, y in zip(pa, pb, strict=True):
        np.testing.assert_array_equal(x, y)


def _final_params(run_dir):
    import jax

    from jaxrl.train.checkpoint import Checkpointer

    ckpt = Checkpointer(run_dir / "checkpoints", every=1, keep=5, use_async=False)
    try:
        step = ckpt.latest_step()
        import orbax.checkpoint as ocp

        raw = ocp.StandardCheckpointer().restore(run_dir / "checkpoints" / str(step) / "state")
        return [np.asarray(x) for x in jax.tree.leaves(raw["params"])]
    finally:
        ckpt.close()


def test_nan_inside_a_step_stops_the_run_after_logging_the_good_steps():
    """nan_policy=stop: the trainer's NonFiniteError (tests/train/test_step.py raises it from a
    NaN on the device) ends the run; the rows before it were logged, the bad step's was not, and
    the generator thread is gone. (nan_policy=skip is checked on a whole run in
    test_run_defects.py::test_skipped_update_keeps_checkpoints_on_pipeline_steps.)"""
    from fake_loop import batch, fake_loop

    from jaxrl.train.trainer import NonFiniteError

    def train(step, produced):
        if step == 1:
            raise NonFiniteError("step 1: non-finite loss or gradient (nan_policy='stop')")
        return {"loss/total": 1.0}, f"params-{step + 1}"

    rows = []
    loop = fake_loop("periodic", produce=lambda step, weights: batch(step, weights()[1]),
                     train=train, publish=lambda params, version: (params, {}), rows=rows)
    with pytest.raises(NonFiniteError, match="non-finite loss or gradient"):
        loop.run(start_step=0, num_steps=4)
    assert [r["loss/total"] for r in rows] == [1.0]  # step 0's row only
    assert not [t for t in threading.enumerate() if t.name == "jaxrl-generator"]
