"""`train/step_s` is the trainer's own time, not the time until the host read the metrics."""

import time

from jaxrl.controller.pipeline import Pipeline, Produced
from jaxrl.train.trainer import Trainer

SLOW_GENERATION_S = 0.8


def test_sync_step_s_excludes_the_next_generation(model_cfg, mesh, train_cfg, make_toy):
    """In `sync` mode the metrics of step s are read when step s + 1 is dispatched, after its
    (deliberately slow) generation; step_s must still hold only the update's own time."""
    trainer = Trainer(model_cfg, train_cfg, mesh)
    batch = make_toy(seed=0, b=8)
    trainer.step(batch)  # compile outside the timed steps
    trainer.flush()
    rows = []

    def produce(step, weights):
        time.sleep(SLOW_GENERATION_S)
        return Produced(step=step, payload=batch, num_rollouts=8, num_tokens=128, busy_s=0.0,
                        min_version=weights()[1])

    def train(step, produced):
        previous = trainer.step(produced.payload)
        if previous is not None:
            rows.append(previous)
        return {}, None

    pipe = Pipeline(mode="sync", produce=produce, train=train,
                    publish=lambda params, version: (params, {}))
    pipe.run(start_step=0, num_steps=3, initial_params=None)
    rows.append(trainer.flush())
    assert len(rows) == 3
    step_s = [row["train/step_s"] for row in rows]
    assert all(0 < s < SLOW_GENERATION_S / 2 for s in step_s), step_s
    assert all(row["train/tokens_per_s"] > 0 for row in rows)
