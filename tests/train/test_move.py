"""Live device moves (jaxrl/rl/rebalance.py): the trainer moved onto another split of
the 8 simulated devices keeps its state bit for bit, and training on continues exactly."""

import jax
import numpy as np
import pytest
from conftest import toy_batch

from jaxrl.rl.rebalance import move_trainer, split_meshes
from jaxrl.train.trainer import Trainer


def _same(a, b):
    return all(jax.tree.leaves(jax.tree.map(
        lambda x, y: bool(np.array_equal(np.asarray(x), np.asarray(y))), a, b)))


def test_moves_keep_state_bit_identical_and_losses_equal(model_cfg, train_cfg):
    """Moves 2:6 -> 4:4 -> 2:6 between steps (fsdp 2 -> 4 -> 2) against no moves: the state
    right after each move equals the state before it (params, Adam moments, step, rng) and every
    step's loss equals the unmoved trainer's (bit for bit at the same fsdp size, else to float
    reduction order)."""
    devices = jax.devices()[:8]
    batches = [toy_batch(seed=30 + i) for i in range(4)]
    still = Trainer(model_cfg, train_cfg, split_meshes(devices, 2).trainer)
    moved = Trainer(model_cfg, train_cfg, split_meshes(devices, 2).trainer)
    losses = {"still": [], "moved": []}
    for i, b in enumerate(batches):
        for name, tr in (("still", still), ("moved", moved)):
            losses[name].append(tr.step(b, seed_step=i)["loss/total"])
        if i in (1, 2):
            before = jax.device_get(moved.state)
            meshes = split_meshes(devices, 4 if i == 1 else 2)
            moved, seconds, nbytes = move_trainer(moved, meshes.trainer)
            assert moved.mesh.shape["fsdp"] == (4 if i == 1 else 2) and seconds > 0
            assert nbytes > 0 and _same(before, moved.state)
            assert set(moved.mesh.devices.flat).isdisjoint(meshes.generator.devices.flat)
            leaf = jax.tree.leaves(moved.state.params)[0]
            assert set(leaf.sharding.device_set) <= set(meshes.trainer.devices.flat)
    # equal up to float reduction order: fsdp 4 sums the batch's gradients over 4 shards, not 2
    # (steps at the same fsdp size as the unmoved trainer are bit-equal: index 0 and 1)
    assert losses["moved"][:2] == losses["still"][:2]
    np.testing.assert_allclose(losses["moved"], losses["still"], rtol=1e-5)


def test_split_meshes_rejects_a_split_tp_does_not_divide():
    with pytest.raises(ValueError, match="does not fit"):
        split_meshes(jax.devices()[:8], 3, trainer_tp=2)
    meshes = split_meshes(jax.devices()[:8], 6, trainer_tp=2)
    assert dict(meshes.trainer.shape) == {"fsdp": 3, "tp": 2}
    assert meshes.generator.size == 2
