"""Live moves in a run (pipeline.rebalance_every, jaxrl/rl/rebalance.py LiveRebalance):
a tiny `sync` run on the 8 simulated devices with forced moves every 2 steps trains on as a run
without moves does. (Moves both ways, 2:6 -> 4:4 -> 2:6, were checked with 5 steps; each move
costs a compilation of the step and the engine, so the tests stop after one.)"""

import numpy as np
import pytest
from run_helpers import tiny_run_config

import jaxrl.run
from jaxrl.rl.metrics import read_metrics

KEYS = ("loss/total", "reward/mean", "train/grad_norm")


def _rows(tmp_path, name, **pipeline):
    cfg = tiny_run_config(tmp_path, name=name, mesh=dict(trainer=(2, 1), generator=(6, 1)),
                          pipeline=dict(steps=3, **pipeline), train=dict(checkpoint_every=0))
    return read_metrics(jaxrl.run.run(cfg, progress=False, evaluate=False).run_dir)


@pytest.fixture(scope="module")
def still(tmp_path_factory):
    return _rows(tmp_path_factory.mktemp("still"), "still")


def _moved_after_step_2(rows):
    assert [r["step"] for r in rows] == [0, 1, 2]
    assert [("rebalance/move_s" in r) for r in rows] == [False, True, False]


def test_forced_moves_at_the_same_fsdp_size_give_the_same_losses(tmp_path, still):
    """A move after step 2 (of 3; every 2 steps): 2:6 -> 2:6 on the other devices (the
    trainer's state onto devices 6-7, the generator rebuilt on 0-5): the losses, rewards and
    gradient norms of a run without moves, bit for bit. (The next forced move would go back.)"""
    same = _rows(tmp_path, "same", rebalance_every=2)
    _moved_after_step_2(same)
    assert [[r[k] for k in KEYS] for r in same] == [[r[k] for k in KEYS] for r in still]
    assert [r["pipeline/trainer_chips"] for r in same] == [2.0] * 3


@pytest.mark.slow
def test_forced_moves_to_another_fsdp_size_give_the_losses_within_1e5(tmp_path, still):
    """2:6 -> 4:4 after step 2 (fsdp 2 -> 4): within rtol 1e-5 of a run without moves (the
    gradient reduction order changes with the fsdp size); the chip counts follow the moves."""
    wider = _rows(tmp_path, "wider", rebalance_every=2, rebalance_to=4)
    _moved_after_step_2(wider)
    assert [r["pipeline/trainer_chips"] for r in wider] == [2.0, 2.0, 4.0]
    assert [r["pipeline/generator_chips"] for r in wider] == [6.0, 6.0, 4.0]
    for k in KEYS:
        np.testing.assert_allclose([r[k] for r in wider], [r[k] for r in still], rtol=1e-5,
                                   err_msg=k)
