"""The default experiment: a tiny model learns `pysynth` (program synthesis from examples) on CPU.

SFT warm start (cached under runs/cache), then GRPO in `periodic` mode with the local sandbox pool.
"""

from jaxrl.config import GenerateConfig, ModelConfig, PipelineConfig, RunConfig
from jaxrl.data.config import DataConfig, SFTConfig
from jaxrl.train.config import TrainConfig


def config() -> RunConfig:
    return RunConfig(
        name="default",
        model=ModelConfig(architecture="qwen2", vocab_size=128, hidden_size=128,
                          intermediate_size=384, num_layers=4, num_heads=4, num_kv_heads=2,
                          qkv_bias=True, max_position_embeddings=256),
        train=TrainConfig(lr=5e-5, warmup_steps=2, logprob_chunk=64, checkpoint_every=5,
                          max_grad_norm=1.0),
        data=DataConfig(task="pysynth", difficulty=1, prompts_per_step=8, group_size=8,
                        max_new_tokens=24, eval_size=64, pass_k=4,
                        sft=SFTConfig(steps=300, batch_size=64)),
        generate=GenerateConfig(num_slots=64, chunk_steps=8),
        pipeline=PipelineConfig(mode="periodic", steps=30),
    )
