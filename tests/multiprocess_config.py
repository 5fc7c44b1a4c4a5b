"""The run of tests/test_multiprocess.py as an experiment file (loaded by every process).

The tiny model of tests/rl/run_helpers.py with a dense test reward, so that every group
carries a learning signal (a random model never solves the real task): the losses, gradients and
parameters that the single- and two-process runs are compared on are then not all zero. The
trainer mesh is fsdp=2: two devices of one process, or one device of each of two processes; the
generator uses one device (per process).
"""

import dataclasses
import sys
import zlib
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent / "rl"))
from run_helpers import tiny_run_config  # noqa: E402

from jaxrl.config import MeshConfig  # noqa: E402
from jaxrl.data import tasks  # noqa: E402
from jaxrl.rewards.rewards import register_reward  # noqa: E402


@register_reward("mp_test_dense", isolated=False, overwrite=True)
def mp_test_dense(prompt, completion, **fields):
    """A deterministic reward in {0, .25, .5, .75, 1} that varies between completions."""
    return (zlib.crc32(completion.encode()) % 5) / 4.0


@tasks.register_task("mp_test", overwrite=True)
def _mp_test_task(cfg):
    base = tasks.build_task(dataclasses.replace(cfg, task="pysynth"))
    return dataclasses.replace(base, name="mp_test", rewards={"mp_test_dense": 1.0})


def config():
    cfg = tiny_run_config(Path("."), name="mp")
    return dataclasses.replace(
        cfg,
        mesh=MeshConfig(trainer=(2, 1), generator=(1, 1), colocated=True),
        # the test's expected counts depend on these (16 rollouts a step, 12 eval items)
        data=dataclasses.replace(cfg.data, task="mp_test", prompts_per_step=4, group_size=4,
                                 eval_size=4, pass_k=2),
        pipeline=dataclasses.replace(cfg.pipeline, mode="sync", steps=3, max_oversample_rounds=0),
    )
