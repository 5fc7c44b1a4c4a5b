"""A tiny multi-turn run (for in-process and subprocess tests): episodes of exactly two turns.

Importing this module registers the environment and the task `test_two_turns`: the first turn
(at most 3 tokens) calls the episode's Python session, whose output comes back as the
observation; the second turn ends the episode with a reward that depends on its tokens (so
groups have variance). Records are `lookup`'s. With JAXRL_TEST_EPISODE_LOG set, each episode
appends its process id and record uid to that file when it starts.
"""

import dataclasses
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from run_helpers import tiny_run_config  # noqa: E402

from jaxrl.data import tasks  # noqa: E402
from jaxrl.envs.base import Environment, Step, register_env  # noqa: E402

NAME = "test_two_turns"


@register_env(NAME, overwrite=True)
class TwoTurns(Environment):
    max_turns = 2
    turn_max_tokens = 3

    def __init__(self, record, tools):
        super().__init__(record, tools)
        log = os.environ.get("JAXRL_TEST_EPISODE_LOG")
        if log:  # which dataset items the run's episodes took, in order (one write per line)
            with open(log, "a") as f:
                f.write(f"{os.getpid()} {record['uid']}\n")

    def step(self, action: str) -> Step:
        if not getattr(self, "asked", False):
            self.asked = True
            r = self.tools.python(f"print({int(self.record['answer'])}, end=';')")
            return Step(observation=f"={r.stdout}")
        return Step(done=True, reward=float(len(set(action)) % 2))


@tasks.register_task(NAME, overwrite=True)
def _task(cfg):
    lookup = tasks.build_task(dataclasses.replace(cfg, task="lookup"))
    return dataclasses.replace(lookup, name=NAME, env=NAME)


def tiny_multiturn_run_config(tmp_path, name="mt", **sections):
    sections["data"] = dict(dict(task=NAME, eval=False, max_new_tokens=12),
                            **sections.get("data", {}))
    return tiny_run_config(tmp_path, name=name, **sections)


def config():
    return tiny_multiturn_run_config(Path("."), name="tiny_mt")
