"""The default experiment: a tiny model learns `pysynth` (program synthesis from examples) on CPU.

SFT warm start (cached under runs/cache), then GRPO in `periodic` mode with the local sandbox pool.
The warm start is deliberately short (held-out pass@1 ~0.15) so RL has room to show what it adds.
"""

from jaxrl.config import GenerateConfig, PipelineConfig, RunConfig
from jaxrl.data.config import DataConfig, SFTConfig
from jaxrl.presets import tiny_task_model_config
from jaxrl.train.config import TrainConfig


def config() -> RunConfig:
    return RunConfig(
        name="default",
        model=tiny_task_model_config(),
        train=TrainConfig(lr=2e-4, warmup_steps=10, logprob_chunk=64, checkpoint_every=10,
                          max_grad_norm=1.0, weight_decay=0.0),
        data=DataConfig(task="pysynth", difficulty=1, prompts_per_step=16, group_size=8,
                        max_new_tokens=24, eval_size=128, pass_k=4,
                        sft=SFTConfig(steps=100, batch_size=32, lr=3e-3)),
        generate=GenerateConfig(num_slots=128, chunk_steps=8),
        pipeline=PipelineConfig(mode="periodic", steps=80),
    )
