"""What every `rl-step` worker shares: the reward, the parameter checksum and the output lines.

Workers run in their own virtual environments (jaxrl is not installed there), so this module
imports only the standard library and numpy; a worker script finds it beside itself on sys.path.
"""

from __future__ import annotations

import json
import resource
import string
import sys
import time

LOWER = frozenset(string.ascii_lowercase)
TAG = "RLSTEP "  # the driver reads only the stdout lines that start with this


def lowercase_share(text: str) -> float:
    """The benchmark's reward: the share of a completion's characters that are a-z. A random
    policy scores ~0.1 with spread inside a group, so advantages (and updates) are non-zero."""
    return sum(c in LOWER for c in text) / max(1, len(text))


def checksum(arrays) -> list[float]:
    """[sum, sum of squares] over every element of `arrays` (numpy-convertible), in float64.
    Layout-free: a transposed, fused or split copy of the same weights has the same checksum,
    so the same saved weights loaded by different frameworks agree."""
    import numpy as np

    total, squares = 0.0, 0.0
    for a in arrays:
        a = np.asarray(a, dtype=np.float64)
        total += float(a.sum())
        squares += float((a * a).sum())
    return [total, squares]


def peak_rss_gb() -> float:
    """This process's peak resident set size so far (Linux reports ru_maxrss in KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def emit(kind: str, **fields) -> None:
    """One result line on stdout for the driver."""
    sys.stdout.write(TAG + json.dumps({"kind": kind, **fields}) + "\n")
    sys.stdout.flush()


def load_workload(assets: str) -> dict:
    """`workload.json` written by the driver: shape, prompts, lengths, learning rate, paths."""
    with open(f"{assets}/workload.json") as f:
        return json.load(f)


def emit_timed_runs(repeats: int, generate_once) -> None:
    """Times `generate_once(i)` (the new ids of each sample) for i < `repeats`; one "run" line
    each, with the samples' shortest and longest new lengths for the driver's length check."""
    for i in range(repeats):
        start = time.perf_counter()
        new = generate_once(i)
        total = time.perf_counter() - start
        lengths = [len(t) for t in new]
        emit("run", total_s=total, samples=len(new), new_min=min(lengths), new_max=max(lengths))
