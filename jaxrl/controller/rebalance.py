"""Live device moves: a different split of the same devices between the trainer and the generator.

At a step boundary the controller may rebuild both meshes with another split (`split_meshes`)
and move the trainer onto its new mesh (`move_trainer`): the train state (params and optimizer
state) is resharded with `jax.device_put` onto the new mesh's shardings, so it is bit-identical
after the move, and the jitted step is rebuilt for that mesh. The policy that decides when and
where to move is jaxrl/planner/rebalance.py (the same code the simulator runs).
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import jax

from jaxrl.config.sections import MeshConfig
from jaxrl.sharding import Meshes, make_meshes


def split_meshes(devices: Sequence[jax.Device], trainer_chips: int, *, trainer_tp: int = 1,
                 generator_tp: int = 1) -> Meshes:
    """Meshes over `devices`: the first `trainer_chips` for the trainer (fsdp x trainer_tp), the
    rest for the generator (dp x generator_tp). Raises ValueError for a split the tp sizes do not
    divide (an infeasible split for the policy)."""
    devices = list(devices)
    gen_chips = len(devices) - trainer_chips
    if not (0 < trainer_chips < len(devices)) or trainer_chips % trainer_tp or \
            gen_chips % generator_tp:
        raise ValueError(f"split {trainer_chips}:{gen_chips} of {len(devices)} devices does not "
                         f"fit trainer tp {trainer_tp} / generator tp {generator_tp}")
    cfg = MeshConfig(trainer=(trainer_chips // trainer_tp, trainer_tp),
                     generator=(gen_chips // generator_tp, generator_tp))
    return make_meshes(cfg, devices)


def move_trainer(trainer, mesh):
    """A Trainer on `mesh` holding `trainer`'s state, bit for bit (with LoRA, its frozen base
    too; the reference policy is resharded). The old trainer's pending metrics (the step in
    flight) carry over, so the one-step-late metrics rows are not broken by a move. Returns
    (new trainer, seconds the move took, the state's bytes moved)."""
    from jaxrl.train.state import train_state_shardings
    from jaxrl.train.trainer import Trainer, tree_bytes

    t0 = time.perf_counter()
    _, shardings = train_state_shardings(trainer.model_cfg, trainer.cfg, mesh)
    state = jax.device_put(trainer.state, shardings)
    lora = trainer.frozen is not None
    new = Trainer(trainer.model_cfg, trainer.cfg, mesh, state=state,
                  params=trainer.frozen if lora else None,
                  ref_params=None if lora else trainer.ref_params, max_len=trainer.max_len)
    new._pending, new._last_done, new._peak = trainer._pending, trainer._last_done, trainer._peak
    new.last_updates = trainer.last_updates
    jax.block_until_ready(new.state)
    moved = tree_bytes(trainer.state) + (tree_bytes(trainer.frozen) if lora else 0)
    return new, time.perf_counter() - t0, moved
