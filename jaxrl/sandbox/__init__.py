"""jaxrl.sandbox: the runtime that runs untrusted code: the zygote program (`zygote`, `syscalls`,
`zygote_session`), tier planning (`plan`), pools (`pool`, `ray_pool`, `session_pool` for tool
sessions) and killable worker processes (`workers`). Stdlib only; it never imports the rewards
above it. RaySandboxPool imports ray on first access."""

from jaxrl.sandbox.pool import LocalSandboxPool
from jaxrl.sandbox.session_pool import SessionPool
from jaxrl.sandbox.types import SandboxJob, SandboxResult
from jaxrl.sandbox.workers import KillableWorkers, RewardTimeout, WorkerError

__all__ = [  # noqa: F822 - RaySandboxPool comes from __getattr__
    "LocalSandboxPool", "RaySandboxPool", "SandboxJob", "SandboxResult", "SessionPool",
    "KillableWorkers", "RewardTimeout", "WorkerError",
]


def __getattr__(name: str):
    if name == "RaySandboxPool":
        from jaxrl.sandbox.ray_pool import RaySandboxPool

        return RaySandboxPool
    raise AttributeError(f"module 'jaxrl.sandbox' has no attribute {name!r}")
