"""Arithmetic word problems with exact answers (math reward), tiny model on CPU."""

from jaxrl.config import GenerateConfig, PipelineConfig, RunConfig
from jaxrl.data.config import DataConfig, SFTConfig
from jaxrl.presets import tiny_task_model_config
from jaxrl.train.config import TrainConfig


def config() -> RunConfig:
    return RunConfig(
        name="arith",
        model=tiny_task_model_config(),
        train=TrainConfig(lr=5e-4, warmup_steps=2, logprob_chunk=64, checkpoint_every=10,
                          weight_decay=0.0),
        data=DataConfig(task="arith", difficulty=0, prompts_per_step=16, group_size=8,
                        max_new_tokens=12, eval_size=128, pass_k=4,
                        sft=SFTConfig(steps=200, batch_size=32, lr=3e-3, max_len=96)),
        generate=GenerateConfig(num_slots=128, chunk_steps=8),
        pipeline=PipelineConfig(mode="periodic", steps=40),
    )
