"""jaxrl's side of `bench.py rl-step`: one `jaxrl.run` of the fixed workload in one mode.

    python jaxrl_worker.py ASSETS_DIR MODE [MICRO_BATCHES [REMAT [noshare]]]
                                                        (MODE: periodic | sync)

MICRO_BATCHES (default 1) is `train.micro_batches`: the update's rows in that many sequential
forward/backward passes (less activation memory, same gradient). REMAT (default "none") is
`train.remat` ("full": each decoder layer's activations recomputed in the backward pass, as TRL's
default gradient checkpointing does). `noshare`: `train.share_prompts=False` (every sample's
prompt computed again in the update).

Runs in the current environment. Prints one `RLSTEP` line per step (warm-ups flagged) from the
run's metrics rows, then a `weights` line: the parameter checksum as the trainer built it
(before any update) and as the run's final checkpoint would save it (no checkpoint is written).
"""

from __future__ import annotations

import sys
import tempfile

import common
import jax

from jaxrl.config import GenerateConfig, PipelineConfig, RunConfig
from jaxrl.data.config import DataConfig
from jaxrl.rewards import register_reward
from jaxrl.run import run
from jaxrl.train import checkpoint
from jaxrl.train.config import TrainConfig


def main(argv: list[str]) -> int:
    assets, mode, *rest = argv
    micro_batches = int(rest[0]) if rest else 1
    remat = rest[1] if len(rest) > 1 else "none"
    share_prompts = not (len(rest) > 2 and rest[2] == "noshare")
    w = common.load_workload(assets)
    register_reward("bench_lowercase", isolated=False)(
        lambda prompt, completion, **_: common.lowercase_share(completion))
    sums: dict[str, list[float]] = {}

    def params_of(state):
        return jax.tree.leaves(jax.device_get(state.params))

    # The checksums ride on the two Checkpointer calls every run makes: check_space before the
    # first step, save after the last (only the final save: checkpoint_every=0).
    def check_space(self, state):
        sums["before"] = common.checksum(params_of(state))

    def save(self, state, step):
        sums["after"] = common.checksum(params_of(state))

    checkpoint.Checkpointer.check_space = check_space
    checkpoint.Checkpointer.save = save
    steps = w["warmup"] + w["steps"]
    with tempfile.TemporaryDirectory() as run_dir:
        cfg = RunConfig(
            name=f"rl-step-{mode}", run_dir=run_dir, init=f"{assets}/model",
            train=TrainConfig(lr=w["lr"], warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0,
                              kl_coef=0.0, checkpoint_every=0, micro_batches=micro_batches,
                              remat=remat, share_prompts=share_prompts),
            data=DataConfig(task="records", paths=(f"{assets}/prompts.jsonl",),
                            eval_paths=(f"{assets}/prompts.jsonl",), epochs=steps + 1,
                            prompts_per_step=w["prompts"], group_size=w["group"],
                            max_new_tokens=w["new_tokens"], prompt_format="plain",
                            reward="bench_lowercase", eval=False, filter_zero_variance=False),
            generate=GenerateConfig(num_slots=w["prompts"] * w["group"], ignore_eos=True),
            pipeline=PipelineConfig(mode=mode, steps=steps))
        result = run(cfg, progress=False, evaluate=False)
    rss = common.peak_rss_gb()
    for i, row in enumerate(result.history):
        mean = row.get("gen/completion_len_mean")
        common.emit("step", step=i, warmup=i < w["warmup"], step_s=row.get("pipeline/step_s"),
                    gen_s=row.get("pipeline/generator_busy_s"),
                    train_s=row.get("pipeline/trainer_busy_s"), rss_gb=rss,
                    new_tokens_mean=mean, samples=row.get("pipeline/batch_size"))
    common.emit("weights", before=sums.get("before"), after=sums.get("after"), peak_rss_gb=rss)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
