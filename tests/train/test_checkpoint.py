"""Checkpoints: save -> drop everything -> restore -> continue is bit-identical; restores onto
another trainer-mesh shape; keeps the last K; carries registered extras; exports to HF."""

import jax
import numpy as np
import pytest

from jaxrl.sharding import make_mesh
from jaxrl.train.checkpoint import Checkpointer, export_hf
from jaxrl.train.state import train_state_shardings
from jaxrl.train.trainer import Trainer


def _equal(a, b):
    same = jax.tree.map(lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)
    return all(jax.tree.leaves(same))


@pytest.fixture(scope="module")
def run(model_cfg, mesh, train_cfg, make_toy, tmp_path_factory):
    """An uninterrupted 4-step run, and a run checkpointed at step 2 (with a data position)."""
    batches = [make_toy(seed=10 + i) for i in range(4)]
    straight = Trainer(model_cfg, train_cfg, mesh)
    for b in batches:
        straight.step(b)

    ckpt_dir = tmp_path_factory.mktemp("ckpt")
    first = Trainer(model_cfg, train_cfg, mesh)
    ckpt = Checkpointer(ckpt_dir, every=2, keep=2)
    data = {"next_batch": 0}
    ckpt.register("data", get=lambda: dict(data), set=data.update)
    for b in batches[:2]:
        first.step(b)
        data["next_batch"] += 1
        ckpt.maybe_save(first.state)  # async; saves at step 2 only
    saved = jax.device_get(first.state)
    ckpt.close()
    return dict(batches=batches, straight=straight, dir=ckpt_dir, saved=saved)


def test_restore_and_continue_is_bit_identical(run, model_cfg, mesh, train_cfg):
    # "kill": nothing of the first run survives but the checkpoint directory.
    resumed = Trainer(model_cfg, train_cfg, mesh)
    ckpt = Checkpointer(run["dir"], every=2, keep=2)
    data = {"next_batch": -1}
    ckpt.register("data", get=lambda: dict(data), set=data.update)
    resumed.replace_state(ckpt.restore(resumed.abstract_state))
    assert ckpt.all_steps() == [2] and data["next_batch"] == 2
    assert int(resumed.state.step) == 2
    for b in run["batches"][data["next_batch"] :]:
        resumed.step(b)
    assert _equal(resumed.state, run["straight"].state), (
        "resumed run diverged from the straight one"
    )
    ckpt.close()


def test_an_extra_added_later_restores_older_checkpoints_with_its_missing_value(
        run, model_cfg, train_cfg, mesh, tmp_path):
    """The run's checkpoint has only "data"; a newer jaxrl also saves "later" (as the batches
    in flight were added): with `missing=` the older checkpoint is whole and restores, the extra
    set to that value; without it the checkpoint counts as damaged."""
    import shutil

    def open_(directory, **missing):
        ckpt = Checkpointer(directory, every=2, keep=2)
        got = {}
        ckpt.register("data", get=dict, set=lambda v: got.update(data=v))
        ckpt.register("later", get=list, set=lambda v: got.update(later=v), **missing)
        return ckpt, got

    abstract = Trainer(model_cfg, train_cfg, mesh).abstract_state
    ckpt, got = open_(run["dir"], missing=None)
    step, state = ckpt.restore_newest(abstract)
    assert step == 2 and got == {"data": {"next_batch": 2}, "later": None}
    assert _equal(state, run["saved"])
    ckpt.close()
    copy = tmp_path / "ckpt"  # restore_newest moves a damaged step aside: on a copy
    shutil.copytree(run["dir"], copy)
    strict, _ = open_(copy)
    with pytest.raises(Exception, match="lacks \\['later'\\]"):
        strict.restore_newest(abstract)
    strict.close()


@pytest.mark.parametrize("shape", [(4, 2), (1, 1)])
def test_restore_onto_another_mesh_shape(run, model_cfg, train_cfg, shape):
    n = shape[0] * shape[1]
    other = make_mesh(shape, "trainer", jax.devices()[-n:])
    abstract, shardings = train_state_shardings(model_cfg, train_cfg, other)
    ckpt = Checkpointer(run["dir"], every=2, keep=2)
    ckpt.register("data", get=dict, set=lambda v: None)
    state = ckpt.restore(abstract)
    assert _equal(state, run["saved"])
    leaf = jax.tree.leaves(state.params)[0]
    assert leaf.sharding == jax.tree.leaves(shardings.params)[0]
    ckpt.close()


def test_keeps_last_k_and_every_n(run, tmp_path):
    state = run["saved"]
    ckpt = Checkpointer(tmp_path, every=2, keep=2)
    for step in range(1, 8):
        ckpt.maybe_save(state.replace(step=np.int32(step)))
    ckpt.wait()
    assert ckpt.all_steps() == [4, 6]
    with pytest.raises(ValueError, match="keep >= 1"):
        Checkpointer(tmp_path / "x", every=1, keep=0)
    ckpt.close()


@pytest.mark.parametrize("where", ["background write", "save call"])
def test_a_full_disk_is_one_error_line_and_keeps_the_last_checkpoint(run, tmp_path, monkeypatch,
                                                                     caplog, where):
    """A disk that fills during a checkpoint write (in orbax's background thread, seen at the
    next wait, or in the save call itself): one `DiskSpaceError` line naming the step, the free
    space and the last complete checkpoint, which stays intact; no orbax tracebacks logged
    (before: the raw OSError and hundreds of lines of them)."""
    import errno

    from jaxrl.train import checkpoint_integrity as integrity
    from jaxrl.train.checkpoint import DiskSpaceError

    def full(*args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path))

    state = run["saved"]
    ckpt = Checkpointer(tmp_path, every=1, keep=3)
    ckpt.save(state.replace(step=np.int32(1)))
    ckpt.wait()
    if where == "background write":
        monkeypatch.setattr(integrity, "seal", full)  # the last write before the rename
    else:
        monkeypatch.setattr(ckpt._manager, "save", full)
    with pytest.raises(DiskSpaceError) as e:
        ckpt.save(state.replace(step=np.int32(2)))
        ckpt.wait()
    text = str(e.value)
    assert "\n" not in text, text
    assert text.startswith("checkpoint step 2 could not be written: the disk is full"), text
    assert " bytes free in " in text and "the last complete checkpoint is step 1" in text, text
    ckpt.close()  # no second error
    assert sorted(p.name for p in tmp_path.iterdir()) == ["1"]  # the partial step removed
    assert integrity.problem(tmp_path / "1") is None
    assert not [r for r in caplog.records if r.exc_info or "No space" in r.getMessage()]


def test_export_hf_round_trips(run, model_cfg, train_cfg, mesh, tmp_path):
    from flax import nnx

    from jaxrl.models.hf import load_pretrained

    tr = run["straight"]
    export_hf(tr.graphdef, tr.state.params, model_cfg, tmp_path / "hf")
    _, model = load_pretrained(tmp_path / "hf")
    back = nnx.to_pure_dict(nnx.state(model))
    close = lambda a, b: np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=0, atol=0)
    jax.tree.map(close, back, jax.device_get(tr.state.params))


_CHILD = """
import os, sys, time
os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
import jax
jax.config.update("jax_default_matmul_precision", "highest")
sys.path.insert(0, {tests!r})
from conftest import toy_batch
from jaxrl.sharding import make_mesh
from jaxrl.testing import tiny_model_config
from jaxrl.train.checkpoint import Checkpointer
from jaxrl.train.config import TrainConfig
from jaxrl.train.trainer import Trainer
mesh = make_mesh((2, 1), "trainer", jax.devices()[:2])
tr = Trainer(tiny_model_config(), TrainConfig(lr=1e-2, logprob_chunk=8, weight_decay=0.0), mesh)
ckpt = Checkpointer({ckpt!r}, every=2, keep=2)
for i in range(2):
    tr.step(toy_batch(seed=10 + i))
ckpt.maybe_save(tr.state)
ckpt.wait()
print("SAVED", flush=True)
time.sleep(600)
"""


@pytest.mark.slow
def test_resume_after_sigkill_is_bit_identical(run, model_cfg, mesh, train_cfg, tmp_path):
    """A separate process trains 2 steps, checkpoints, and is killed with SIGKILL; this process
    restores and continues: bit-identical to the uninterrupted run (same data, same order)."""
    import os
    import signal
    import subprocess
    import sys

    ckpt_dir = tmp_path / "ckpt"
    code = _CHILD.format(tests=os.path.dirname(__file__), ckpt=str(ckpt_dir))
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "SAVED"
    finally:
        child.send_signal(signal.SIGKILL)
        child.wait()
    resumed = Trainer(model_cfg, train_cfg, mesh)
    ckpt = Checkpointer(ckpt_dir, every=2, keep=2)
    resumed.replace_state(ckpt.restore(resumed.abstract_state))
    for b in run["batches"][2:]:
        resumed.step(b)
    assert _equal(resumed.state, run["straight"].state)
    ckpt.close()
