"""What every `rl-step` worker shares: the reward, the parameter checksum and the output lines.

Workers run in their own virtual environments (jaxrl is not installed there), so this module
imports only the standard library and numpy; a worker script finds it beside itself on sys.path.
"""

from __future__ import annotations

import json
import resource
import string
import sys

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
