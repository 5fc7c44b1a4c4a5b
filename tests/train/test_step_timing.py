"""`train/step_s` is the trainer's own time, not the time the host spent elsewhere between
updates (a `sync` step's generation)."""

import time

from jaxrl.train.trainer import Trainer

SLOW_GENERATION_S = 0.8


def test_step_s_excludes_the_generation_between_updates(model_cfg, mesh, train_cfg, make_toy):
    trainer = Trainer(model_cfg, train_cfg, mesh)
    batch = make_toy(seed=0, b=8)
    trainer.step(batch)  # compile outside the timed steps
    rows = []
    for _ in range(3):
        time.sleep(SLOW_GENERATION_S)  # what a sync step's generation does between updates
        rows.append(trainer.step(batch))
    step_s = [row["train/step_s"] for row in rows]
    assert all(0 < s < SLOW_GENERATION_S / 2 for s in step_s), step_s
    assert all(row["train/tokens_per_s"] > 0 for row in rows)
