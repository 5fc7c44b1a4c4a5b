"""Multi-turn episodes with a Python tool session per episode (`lookup`: ask the tool, then
answer its digit), tiny model on CPU. The SFT warm start teaches the format with wrong digits;
RL has to learn to copy the tool's answer (reward 0.1 by chance, 1 when copied)."""

from jaxrl.config import GenerateConfig, PipelineConfig, RunConfig
from jaxrl.data.config import DataConfig, SFTConfig
from jaxrl.presets import tiny_task_model_config
from jaxrl.train.config import TrainConfig


def config() -> RunConfig:
    return RunConfig(
        name="multiturn",
        model=tiny_task_model_config(),
        train=TrainConfig(lr=5e-4, warmup_steps=2, logprob_chunk=32, checkpoint_every=5,
                          weight_decay=0.0),
        data=DataConfig(task="lookup", prompts_per_step=8, group_size=8, max_new_tokens=12,
                        eval_size=32, pass_k=2,
                        sft=SFTConfig(steps=100, batch_size=32, lr=3e-3, max_len=32)),
        generate=GenerateConfig(num_slots=32, chunk_steps=4),
        pipeline=PipelineConfig(mode="periodic", steps=200),
    )
