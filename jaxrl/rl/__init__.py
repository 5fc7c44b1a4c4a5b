"""The RL step, one module per verb: `loop` (modes, lead, staleness), `rollout` (generate +
score), `update` (batch -> Trainer.step), `sync` (weights to the generator), `hooks` (evaluation,
checkpoints). docs/architecture.md says where to change each."""
