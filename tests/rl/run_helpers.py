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



def has_sealed_checkpoint(run_dir) -> bool:
    """Whether `run_dir/checkpoints` holds a finished checkpoint: a step directory (orbax renames
    it into place only when written) with jaxrl's integrity record. Checkpoints are written in
    the background, so a logged step does not mean its checkpoint is on disk yet: a test that
    SIGKILLs a run to resume it waits for this too."""
    from pathlib import Path

    from jaxrl.train.checkpoint_integrity import RECORD

    root = Path(run_dir) / "checkpoints"
    return root.is_dir() and any(p.name.isdigit() and (p / RECORD).is_file()
                                 for p in root.iterdir())
