"""Job and result records shared by the sandbox pools and the reward functions."""

from __future__ import annotations

import dataclasses
from typing import Literal

Status = Literal["ok", "error", "timeout", "oom", "killed", "output_limit"]
STATUSES: tuple[str, ...] = ("ok", "error", "timeout", "oom", "killed", "output_limit")


@dataclasses.dataclass(frozen=True)
class SandboxJob:
    """One untrusted Python program to run in a sandbox slot.

    `files` maps relative paths (inside the job's private working directory) to contents.
    `memory_mb` caps the address space (RLIMIT_AS); `timeout_s` is wall-clock (sleeping counts).
    """

    code: str
    stdin: str = ""
    timeout_s: float = 5.0
    memory_mb: int = 512
    files: dict[str, str | bytes] = dataclasses.field(default_factory=dict)
    max_output_bytes: int = 1 << 20  # per stream; more ends the job with status "output_limit"


@dataclasses.dataclass(frozen=True)
class SandboxResult:
    """What came back from one job. `exit_code` is informative only, never a verdict."""

    status: Status
    exit_code: int | None
    stdout: str
    stderr: str
    wall_s: float  # execution time of the job itself
    queue_s: float  # time the job waited for a free slot
    start_s: float = 0.0  # time from dispatch to the job's child running
