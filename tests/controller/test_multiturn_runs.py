"""Whole runs with multi-turn episodes: every pipeline mode."""

import pytest
from tiny_multiturn_config import tiny_multiturn_run_config

import jaxrl.run
from jaxrl.controller import learner
from jaxrl.controller.metrics import read_metrics
from jaxrl.controller.pipeline import ahead_for

SMALL = dict(prompts_per_step=2, group_size=2)


@pytest.mark.slow
def test_every_pipeline_mode_completes_a_multiturn_run(tmp_path, monkeypatch):
    seen = []  # (mode, trainer version, [per-token versions of the model's tokens])
    real = learner.staleness_stats

    def spy(groups, trainer_version):
        for g in groups:
            for r in g.rollouts:
                seen.append((mode, trainer_version,
                             [v for v, m in zip(r.versions, r.mask, strict=True) if m]))
        return real(groups, trainer_version)

    monkeypatch.setattr(learner, "staleness_stats", spy)
    k = 2
    for mode in ("sync", "periodic", "async", "inflight"):
        cfg = tiny_multiturn_run_config(
            tmp_path, name=mode, data=SMALL, pipeline=dict(mode=mode, max_staleness=k, steps=2),
            train=dict(correction="tis_token" if mode == "inflight" else "none"))
        rows = read_metrics(jaxrl.run.run(cfg, progress=False).run_dir)
        assert [r["step"] for r in rows] == [0, 1], mode
        for r in rows:
            assert r["env/turns_mean"] == 2.0, mode
            assert r["generator/slots_waiting_on_tools"] == 0.0
            assert 0 <= r["staleness/max"] <= ahead_for(mode, k), mode
        lags = [v - t for m, t, vs in seen if m == mode for v in vs]
        assert lags and all(-ahead_for(mode, k) <= lag <= 0 for lag in lags), mode
    # staleness is counted on the model's tokens of every turn: versions never go back in time
    # inside an episode (inflight may move them forward between turns)
    assert all(vs == sorted(vs) for _, _, vs in seen)
