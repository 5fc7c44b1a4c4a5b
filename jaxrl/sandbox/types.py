"""Job and result records shared by the sandbox pools and the reward functions."""

from __future__ import annotations

import dataclasses
from typing import Literal

from jaxrl.sandbox.zygote import STATUSES, check_job_path

__all__ = ["STATUSES", "MAX_CODE_BYTES", "MAX_OUTPUT_CAP", "SandboxJob", "SandboxResult",
           "Status", "validate_jobs"]

Status = Literal["ok", "error", "timeout", "oom", "killed", "output_limit"]  # == zygote.STATUSES
MAX_CODE_BYTES = 4 << 20  # characters of `SandboxJob.code`
MAX_OUTPUT_CAP = 64 << 20  # the largest allowed `SandboxJob.max_output_bytes`


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


def validate_jobs(jobs) -> list[SandboxJob]:
    """Checks jobs before they reach a pool; errors name the job, the field and the range."""
    jobs = list(jobs)
    for i, job in enumerate(jobs):
        if not isinstance(job, SandboxJob):
            raise TypeError(f"jobs[{i}] must be a SandboxJob, got {type(job).__name__}")
        if not isinstance(job.code, str) or len(job.code) > MAX_CODE_BYTES:
            raise ValueError(f"jobs[{i}].code must be a str of at most {MAX_CODE_BYTES} chars")
        if not (isinstance(job.timeout_s, int | float) and 0 < job.timeout_s <= 3600):
            raise ValueError(f"jobs[{i}].timeout_s must be in (0, 3600] s, got {job.timeout_s!r}")
        if not (isinstance(job.memory_mb, int) and 32 <= job.memory_mb <= 1 << 20):
            raise ValueError(f"jobs[{i}].memory_mb must be an int in [32, 1048576], "
                             f"got {job.memory_mb!r}")
        cap = job.max_output_bytes
        if not (isinstance(cap, int) and 0 < cap <= MAX_OUTPUT_CAP):
            raise ValueError(f"jobs[{i}].max_output_bytes must be in (0, {MAX_OUTPUT_CAP}], "
                             f"got {job.max_output_bytes!r}")
        if not isinstance(job.stdin, str | bytes):
            raise ValueError(f"jobs[{i}].stdin must be str or bytes, "
                             f"got {type(job.stdin).__name__}")
        for name, content in job.files.items():
            check_job_path(name)
            if not isinstance(content, str | bytes):
                raise ValueError(f"jobs[{i}].files[{name!r}] must be str or bytes")
    return jobs
