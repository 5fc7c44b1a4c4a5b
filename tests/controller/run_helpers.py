"""A very small run configuration shared by the controller's end-to-end tests."""

import dataclasses

from jaxrl.config import GenerateConfig, MeshConfig, PipelineConfig, RunConfig
from jaxrl.data.config import DataConfig, SFTConfig
from jaxrl.presets import tiny_model_config
from jaxrl.train.config import TrainConfig


def tiny_run_config(tmp_path, name="t", **sections) -> RunConfig:
    cfg = RunConfig(
        name=name,
        run_dir=str(tmp_path / "runs"),
        model=tiny_model_config(hidden_size=32, intermediate_size=64, num_heads=2,
                                num_kv_heads=1),
        mesh=MeshConfig(trainer=(1, 1), generator=(1, 1)),
        train=TrainConfig(lr=1e-3, logprob_chunk=32, checkpoint_every=2),
        data=DataConfig(task="pysynth", difficulty=0, prompts_per_step=4, group_size=4,
                        max_new_tokens=8, eval_size=4, pass_k=2,
                        sft=SFTConfig(steps=0, cache_dir=str(tmp_path / "cache"))),
        generate=GenerateConfig(num_slots=16, chunk_steps=4),
        pipeline=PipelineConfig(mode="sync", steps=3, max_oversample_rounds=0),
    )
    for key, value in sections.items():
        cfg = dataclasses.replace(cfg, **{key: dataclasses.replace(getattr(cfg, key), **value)})
    return cfg

