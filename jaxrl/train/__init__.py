"""jaxrl.train: the trainer (kept import-free; import the submodules you need).

config.TrainConfig        every trainer setting, validated on construction (no jax import)
algorithms                registered RL maths: advantages, policy losses, aggregation, KL,
                          off-policy corrections, overlong penalty
batch.Batch / make_batch  the batch format and its alignment rules
trainer.Trainer           owns the TrainState; step(batch) -> previous step's metrics
step.make_train_step      the pure jitted train_step(state, batch) -> (state, metrics)
state.TrainState          params, optimiser state, step, rng (+ non-finite skip count)
logprobs                  chunked per-token logprob pass (proximal / reference policies)
checkpoint.Checkpointer   orbax save / restore (any trainer mesh), export_hf
flops                     model FLOPs and backend peak for train/mfu
"""
