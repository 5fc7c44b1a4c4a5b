"""The fixed end-to-end RL workload of `bench.py suite` (rl_step and pipeline entries).

The same on every backend and at every suite size, so rows of different machines compare: the
~0.8M-parameter synthetic-task model (4 layers, width 128, vocab 128, `tiny_task_model_config`),
random init (no SFT warm start), `pysynth` difficulty 1 prompts (the task's seeded prompt stream),
8 prompts x group 4 = 32 rollouts per step, at most 16 new tokens each, one trainer device and one
generator device, GRPO defaults, evaluation and checkpoints off. The suite's size only changes how
many steps are timed.
"""

from jaxrl.config import GenerateConfig, MeshConfig, PipelineConfig, RunConfig
from jaxrl.data.config import DataConfig, SFTConfig
from jaxrl.presets import tiny_task_model_config
from jaxrl.train.config import TrainConfig

PROMPTS_PER_STEP, GROUP_SIZE, MAX_NEW_TOKENS = 8, 4, 16


def config() -> RunConfig:
    return RunConfig(
        name="bench-suite",
        model=tiny_task_model_config(),
        mesh=MeshConfig(trainer=(1, 1), generator=(1, 1)),
        train=TrainConfig(lr=2e-4, logprob_chunk=64, checkpoint_every=0),
        data=DataConfig(task="pysynth", difficulty=1, prompts_per_step=PROMPTS_PER_STEP,
                        group_size=GROUP_SIZE, max_new_tokens=MAX_NEW_TOKENS, eval_size=4,
                        pass_k=1, sft=SFTConfig(steps=0)),
        generate=GenerateConfig(num_slots=PROMPTS_PER_STEP * GROUP_SIZE, chunk_steps=8),
        pipeline=PipelineConfig(mode="sync", steps=3),
    )
