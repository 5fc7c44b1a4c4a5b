"""Integer rounding rules shared by the run, the generator and the planner (defined once).

    next_power_of_two(n, minimum=1)  the smallest power of two >= n and >= minimum: generator
                                     replica sizes, service batch shapes
    round_up(n, multiple)            the smallest multiple of `multiple` >= n: slots over the
                                     data-parallel replicas, batch rows over the trainer mesh
    kv_cache_len(positions, page)    a run's automatic KV cache length (`generate.max_len=0`)
    power_of_two_parts(n, limit)     calls of power-of-two rows covering n rows: batched prefill

Plain Python; imports nothing.
"""

from __future__ import annotations

import math


def next_power_of_two(n: float, minimum: int = 1) -> int:
    """The smallest power of two that is >= `n` and >= `minimum` (itself a power of two >= 1).

    `n` may be a real number (e.g. a memory ratio): the result is the smallest power of two p
    with p >= n. Examples: (1) -> 1, (5) -> 8, (16) -> 16, (17) -> 32, (3, minimum=16) -> 16,
    (2.5) -> 4, (0) -> 1.
    """
    if minimum < 1 or minimum & (minimum - 1):
        raise ValueError(f"next_power_of_two: minimum must be a power of two >= 1, got {minimum!r}")
    if n <= minimum:
        return minimum
    return 1 << (math.ceil(n) - 1).bit_length()


def round_up(n: int, multiple: int) -> int:
    """The smallest multiple of `multiple` that is >= `n`: (10, 4) -> 12, (12, 4) -> 12,
    (0, 4) -> 0."""
    if multiple < 1:
        raise ValueError(f"round_up: multiple must be >= 1, got {multiple!r}")
    return -(-n // multiple) * multiple


KV_CACHE_MULTIPLE = 16  # automatic KV cache lengths are multiples of this (and of the page size)


def kv_cache_len(positions: int, page_size: int = 1) -> int:
    """KV-cache positions per slot when `generate.max_len` is 0: `positions` (the run's sequence
    capacity) rounded up to a multiple of 16 and of `page_size` (the paged layout's; 1 for the
    contiguous one), at least 16.
    Not to a power of two: decode attention reads the whole cache row, and the 132 positions of
    the rl-step benchmark padded to 256 made its generation ~20% slower than 144 (paired A/B in
    docs/benchmarks.md). Examples: (132) -> 144, (128) -> 128, (5) -> 16, (132, 64) -> 192."""
    if page_size < 1:
        raise ValueError(f"kv_cache_len: page_size must be >= 1, got {page_size!r}")
    return round_up(max(positions, 1), math.lcm(KV_CACHE_MULTIPLE, page_size))


def power_of_two_parts(n: int, limit: int, max_pad: float = 0.125) -> list[int]:
    """Row counts (powers of two <= `limit`, largest first) of the calls that cover `n` rows.

    The rest is padded up to the next power of two only while the padding is one row or at most
    `max_pad` of that call (a call has a cost of its own, so one padding row beats a call more);
    otherwise the largest power of two that fits is split off and the remainder covered the same
    way, so little compute goes to padding rows and only powers of two compile. Examples
    (limit 16): 3 -> [4], 7 -> [8], 9 -> [8, 1], 12 -> [8, 4], 13 -> [8, 4, 1], 14 -> [16].
    """
    if not isinstance(n, int) or n < 0 or not isinstance(limit, int) or limit < 1:
        raise ValueError(f"power_of_two_parts: n must be an integer >= 0 and limit >= 1, "
                         f"got n={n!r}, limit={limit!r}")
    cap = 1 << (limit.bit_length() - 1)  # the largest power of two <= limit
    parts: list[int] = []
    while n > 0:
        whole = next_power_of_two(n)
        if whole <= cap and whole - n <= max(1.0, max_pad * whole):
            parts.append(whole)
            break
        part = min(cap, whole // 2)
        parts.append(part)
        n -= part
    return parts
