"""RaySandboxPool: the same zygote sandboxes as `LocalSandboxPool`, as Ray actors on every node.

    pool = RaySandboxPool()              # ray.init() if needed; one actor per CPU on every node
    results = pool.run(jobs)             # jobs go out in batches, one Ray call per batch
    pool.stats()                         # queue wait (Ray + local), start and execution time

Each actor owns a one-worker `LocalSandboxPool` (probed tier, per-slot uid, zygote), so isolation is
identical to the local pool on every host. Needs the `ray` extra; ray is imported only here, lazily.
A dead actor is replaced on the same node and its batch retried once; a batch that kills two
actors reports "killed" for its jobs.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import math
import socket
import threading
import time

from jaxrl.sandbox.plan import _cleanup_plans
from jaxrl.sandbox.pool import LocalSandboxPool, PoolStats, metrics, validate_jobs
from jaxrl.sandbox.types import SandboxJob, SandboxResult


def _import_ray():
    try:
        import ray
    except ImportError as e:
        raise ImportError("RaySandboxPool needs ray: pip install 'jaxrl[ray]' (ray>=2.40)") from e
    return ray


class _SandboxActor:
    """Runs inside a Ray worker process: one warm zygote slot."""

    def __init__(self, tier: str):
        self.pool = LocalSandboxPool(num_workers=1, tier=tier)

    def info(self) -> dict:
        return dict(tier=self.pool.tier, detail=self.pool.tier_detail, host=socket.gethostname(),
                    uids=self.pool.slot_uids)

    def run_batch(self, jobs: list[SandboxJob]) -> tuple[float, list[SandboxResult]]:
        return time.time(), self.pool.run(jobs)

    def stats(self) -> dict:
        return self.pool.stats()

    def close(self) -> None:
        self.pool.close()
        _cleanup_plans()  # the actor is killed next: no exit handlers run there


class RaySandboxPool:
    """Sandboxed execution on a Ray cluster. `num_workers` caps the actor count (default: one per
    CPU on every alive node); `batch_size` is jobs per Ray call (default: spread each `run` over
    about two batches per actor)."""

    def __init__(self, num_workers: int | None = None, *, tier: str = "auto",
                 address: str | None = None, batch_size: int | None = None, **ray_init_kwargs):
        ray = self._ray = _import_ray()
        if num_workers is not None and (not isinstance(num_workers, int) or num_workers < 1):
            raise ValueError(f"num_workers must be a positive int or None, got {num_workers!r}")
        if batch_size is not None and (not isinstance(batch_size, int) or batch_size < 1):
            raise ValueError(f"batch_size must be a positive int or None, got {batch_size!r}")
        self._owns_ray = not ray.is_initialized()
        if self._owns_ray:
            ray.init(address=address, **ray_init_kwargs)
        self._actor_cls = ray.remote(num_cpus=1)(_SandboxActor)
        self._tier_req, self.batch_size, self.restarts = tier, batch_size, 0
        per_node = [[n["NodeID"]] * int(n.get("Resources", {}).get("CPU", 0))
                    for n in ray.nodes() if n.get("Alive")]
        # Round-robin over nodes, so a `num_workers` cap spreads across hosts.
        self._nodes: list[str] = [ids[i] for i in range(max(map(len, per_node), default=0))
                                  for ids in per_node if i < len(ids)][:num_workers]
        if not self._nodes:
            raise RuntimeError("RaySandboxPool: the Ray cluster has no alive node with a CPU")
        self._actors = [self._new_actor(n) for n in self._nodes]
        infos = ray.get([a.info.remote() for a in self._actors])
        self.num_workers = len(self._actors)
        tiers = sorted({i["tier"] for i in infos})
        self.tier = tiers[0] if len(tiers) == 1 else "mixed:" + ",".join(tiers)
        self.tier_detail = "; ".join(sorted({f"{i['host']}: {i['detail']}" for i in infos}))
        self.slot_uids = sorted({u for i in infos for u in i["uids"]})  # of the first actors
        self._stats = PoolStats()
        self._lock = threading.Lock()
        self._executor = concurrent.futures.ThreadPoolExecutor(2, thread_name_prefix="ray-sandbox")
        self._closed = False

    def _new_actor(self, node_id: str):
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        strategy = NodeAffinitySchedulingStrategy(node_id=node_id, soft=False)
        return self._actor_cls.options(scheduling_strategy=strategy).remote(self._tier_req)

    def submit(self, jobs: list[SandboxJob]) -> concurrent.futures.Future:
        """Runs `jobs` in the background; the future resolves to their results, in order."""
        if self._closed:
            raise RuntimeError("RaySandboxPool is closed")
        jobs = validate_jobs(jobs)
        return self._executor.submit(self._run, jobs)

    def run(self, jobs: list[SandboxJob]) -> list[SandboxResult]:
        return self.submit(jobs).result()

    def _run(self, jobs: list[SandboxJob]) -> list[SandboxResult]:
        ray, n = self._ray, len(jobs)
        if not n:
            return []
        size = self.batch_size or max(1, math.ceil(n / (2 * self.num_workers)))
        batches = [list(range(i, min(n, i + size))) for i in range(0, n, size)]
        results: list = [None] * n
        pending: dict = {}  # object ref -> (batch index, actor index, dispatch time, attempt)
        free = list(range(self.num_workers)) * 2  # at most two batches in flight per actor
        todo = [(b, 0) for b in range(len(batches))][::-1]
        while todo or pending:
            while todo and free:
                b, attempt = todo.pop()
                a = free.pop(0)
                with self._lock:
                    actor = self._actors[a]
                ref = actor.run_batch.remote([jobs[i] for i in batches[b]])
                pending[ref] = (b, a, actor, time.time(), attempt)
            done, _ = ray.wait(list(pending), num_returns=1)
            ref = done[0]
            b, a, actor, t_sent, attempt = pending.pop(ref)
            free.append(a)
            try:
                t_started, got = ray.get(ref)
            except ray.exceptions.RayError as e:
                died = not isinstance(e, ray.exceptions.RayTaskError)  # not a raise inside it
                if died:
                    self._replace(a, actor)
                if died and attempt == 0:
                    todo.append((b, 1))
                    continue
                why = "died twice" if died else "failed"
                got = [SandboxResult("killed", None, "", f"sandbox actor {why}: {e}", 0.0, 0.0)
                       for _ in batches[b]]
                t_started = t_sent
            ray_wait = max(0.0, t_started - t_sent)  # includes cross-host clock skew, if any
            for i, r in zip(batches[b], got, strict=True):
                results[i] = dataclasses.replace(r, queue_s=r.queue_s + ray_wait)
                self._stats.record(results[i])
        return results

    def _replace(self, a: int, dead) -> None:
        with self._lock:
            if self._actors[a] is not dead:
                return  # another failed batch of the same actor replaced it already
            self.restarts += 1
            try:
                self._ray.kill(self._actors[a])
            except Exception:  # noqa: BLE001 - already dead
                pass
            self._actors[a] = self._new_actor(self._nodes[a])

    def stats(self) -> dict:
        """Like `LocalSandboxPool.stats()`; `restarts` counts actor and zygote replacements,
        `restart_failures` the actors' failed zygote restarts."""
        try:
            inner = self._ray.get([a.stats.remote() for a in self._actors], timeout=30)
            zygote_restarts = sum(s["restarts"] for s in inner)
            restart_failures = sum(s.get("restart_failures", 0) for s in inner)
        except Exception:  # noqa: BLE001 - an actor being replaced
            zygote_restarts = restart_failures = 0
        return dict(tier=self.tier, tier_detail=self.tier_detail, workers=self.num_workers,
                    restarts=self.restarts + zygote_restarts, restart_failures=restart_failures,
                    **self._stats.summary())

    def metrics(self) -> dict[str, float]:
        return metrics(self.stats())

    def close(self) -> None:
        """Closes every actor's pool, kills the actors; shuts Ray down if this pool started it."""
        if self._closed:
            return
        self._closed = True
        self._executor.shutdown(wait=True)
        ray = self._ray
        try:
            ray.get([a.close.remote() for a in self._actors], timeout=60)
        except Exception:  # noqa: BLE001 - kill below anyway
            pass
        for a in self._actors:
            ray.kill(a)
        if self._owns_ray:
            ray.shutdown()

    def __enter__(self) -> RaySandboxPool:
        return self

    def __exit__(self, *exc) -> None:
        self.close()
