"""A damaged or half-written checkpoint is never restored: `restore_newest` falls back to the
newest complete one, says which it skipped and why, and moves it aside; with none usable it
raises a clear error (it used to end --resume in a raw orbax traceback, or restore garbled
bytes silently)."""

import logging
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.train.checkpoint import Checkpointer, CheckpointError


def _state(step):
    return {"params": {"w": jnp.arange(1000, dtype=jnp.float32) * step,
                       "b": jnp.full((3,), float(step))},
            "step": jnp.array(step, jnp.int32)}


def _checkpointer(directory, data):
    ckpt = Checkpointer(directory, every=1, keep=5)
    ckpt.register("data", get=lambda: dict(data), set=data.update)
    return ckpt


@pytest.fixture(scope="module")
def written(tmp_path_factory):
    """Checkpoints at steps 1 and 2, each sealed, written once and copied per test."""
    directory = tmp_path_factory.mktemp("written") / "checkpoints"
    data = {}
    ckpt = _checkpointer(directory, data)
    for step in (1, 2):
        data["position"] = step
        ckpt.save(_state(step), step=step)
    ckpt.close()
    return directory


def _garble(path):
    raw = bytearray(path.read_bytes())
    raw[len(raw) // 2: len(raw) // 2 + 16] = bytes(16)
    path.write_bytes(bytes(raw))


def _params_data(step_dir):  # the largest array file: the params
    return max((step_dir / "state").rglob("d/*"), key=lambda p: p.stat().st_size)


DAMAGE = {
    "params data garbled": (lambda d: _garble(_params_data(d)), "checksum mismatch"),
    "params data truncated": (lambda d: _params_data(d).write_bytes(
        _params_data(d).read_bytes()[:100]), "truncated"),
    "params data deleted": (lambda d: _params_data(d).unlink(), "is missing"),
    "state metadata garbled": (lambda d: (d / "state" / "_METADATA").write_text("{garbled"),
                               "state/_METADATA is not readable JSON"),
    "step metadata missing": (lambda d: (d / "_CHECKPOINT_METADATA").unlink(),
                              "_CHECKPOINT_METADATA is missing"),
    "extra data state truncated": (lambda d: (d / "extra" / "metadata").write_text('{"da'),
                                   "extra/metadata is not readable JSON"),
    "extra data state without the item": (lambda d: (d / "extra" / "metadata").write_text("{}"),
                                          "lacks ['data']"),
}


def _abstract():
    sharding = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    return jax.tree.map(lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=sharding),
                        _state(0))


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_each_damaged_part_falls_back_to_the_previous_checkpoint(written, tmp_path, caplog,
                                                                 damage):
    directory = tmp_path / "checkpoints"
    shutil.copytree(written, directory)
    harm, reason = DAMAGE[damage]
    harm(directory / "2")
    data = {}
    ckpt = _checkpointer(directory, data)
    with caplog.at_level(logging.WARNING, logger="jaxrl"):
        step, state = ckpt.restore_newest(_abstract())
    assert step == 1 and data == {"position": 1}
    np.testing.assert_array_equal(state["params"]["w"], np.arange(1000) * 1.0)
    assert "checkpoint step 2 skipped: " in caplog.text and reason in caplog.text
    aside = list((tmp_path / "damaged_checkpoints").iterdir())  # moved aside, not deleted
    assert len(aside) == 1 and aside[0].name.startswith("2-")
    assert reason in (aside[0] / "why.txt").read_text()
    assert ckpt.all_steps() == [1]
    data["position"] = 2  # the resumed run saves step 2 again
    assert ckpt.save(_state(2), step=2)
    ckpt.close()
    assert _checkpointer(directory, {}).restore_newest(_abstract())[0] == 2


def test_an_intact_checkpoint_is_restored_and_a_half_written_one_is_not(written, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(written, directory)
    shutil.copytree(directory / "2", directory / "3.orbax-checkpoint-tmp")  # cut off by SIGKILL
    ckpt = _checkpointer(directory, {})
    assert ckpt.all_steps() == [1, 2]
    step, state = ckpt.restore_newest(_abstract())
    assert step == 2 and int(state["step"]) == 2
    assert not (tmp_path / "damaged_checkpoints").exists()
    ckpt.close()


def test_no_usable_checkpoint_is_a_clear_error_that_changes_nothing(written, tmp_path):
    directory = tmp_path / "checkpoints"
    shutil.copytree(written, directory)
    _garble(_params_data(directory / "2"))
    (directory / "1" / "extra" / "metadata").unlink()
    ckpt = _checkpointer(directory, {})
    with pytest.raises(CheckpointError, match=r"no usable checkpoint in .*step 2: .*checksum "
                       r"mismatch.*step 1: extra/metadata is missing.*another --name"):
        ckpt.restore_newest(_abstract())
    assert ckpt.all_steps() == [1, 2] and not (tmp_path / "damaged_checkpoints").exists()
    ckpt.close()


def test_too_little_free_space_stops_before_writing_and_keeps_the_last_checkpoint(
        written, tmp_path, monkeypatch):
    from jaxrl.train import checkpoint

    directory = tmp_path / "checkpoints"
    shutil.copytree(written, directory)
    one = checkpoint.state_bytes(_state(0))
    assert one == 1000 * 4 + 3 * 4 + 4
    ckpt = _checkpointer(directory, {"position": 3})
    ckpt.check_space(_abstract())  # this disk has room
    monkeypatch.setattr(checkpoint, "free_bytes", lambda d: 2 * one - 1)
    with pytest.raises(checkpoint.DiskSpaceError,
                       match=rf"not enough free space for checkpoints in {directory}: "
                             rf"{2 * one - 1:,} bytes free, {2 * one:,} needed \(2 checkpoints "
                             rf"of {one:,} bytes\); the last complete checkpoint \(step 2\) is "
                             r"kept; free space there"):
        ckpt.save(_state(3), step=3)
    with pytest.raises(checkpoint.DiskSpaceError):  # the check before a run starts
        ckpt.check_space(_abstract())
    ckpt.wait()
    assert sorted(p.name for p in directory.iterdir()) == ["1", "2"]  # nothing half-written
    assert ckpt.restore_newest(_abstract())[0] == 2
    ckpt.close()
