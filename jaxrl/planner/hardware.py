"""Accelerator specs: a datasheet table for GPUs and TPUs (data/hardware.toml, one row per chip
with its source and date), and a measured entry for the local CPU.

Peak figures are dense BF16 (no structured sparsity). `ici_bw` is the per-chip scale-up link
(NVLink / TPU ICI), `dcn_bw` the per-chip scale-out network used when the trainer and the
generator sit on different nodes (8 GPUs per node with one 400 Gb/s NIC per GPU on DGX/HGX
systems; TPU slices are ICI-connected, so both are ICI there).

The CPU entry is never a constant: `local_cpu()` measures a float32 numpy matmul (the CPU has
no BF16 peak to quote; JAX on CPU computes in float32 too) and a memory copy once, and caches the
result under $JAXRL_CACHE_DIR or ~/.cache/jaxrl.
"""

from __future__ import annotations

import dataclasses
import json
import os
import platform
import time
from collections.abc import Callable, Mapping
from importlib.resources.abc import Traversable

import numpy as np

from jaxrl.planner import tables


@dataclasses.dataclass(frozen=True)
class HardwareSpec:
    name: str
    peak_flops: float     # dense BF16 FLOP/s per chip (float32 for the measured CPU)
    hbm_bytes: float      # memory per chip
    hbm_bw: float         # memory bandwidth per chip, bytes/s
    ici_bw: float         # scale-up bandwidth per chip, bytes/s (one direction)
    dcn_bw: float         # scale-out bandwidth per chip, bytes/s
    chips_per_node: int   # chips sharing the scale-up domain (the split granularity)
    source: str
    date: str = ""        # when the figures were read (measured), YYYY-MM-DD

    def __post_init__(self):
        for field in ("peak_flops", "hbm_bytes", "hbm_bw", "ici_bw", "dcn_bw"):
            if not getattr(self, field) > 0:
                raise ValueError(f"{self.name}: {field} must be > 0, got {getattr(self, field)}")
        if self.chips_per_node < 1:
            raise ValueError(f"{self.name}: chips_per_node must be >= 1, got "
                             f"{self.chips_per_node}")

    def link_bw(self, chips: int) -> float:
        """Per-chip bandwidth for transfers among `chips` chips: scale-up inside one node."""
        return self.ici_bw if chips <= self.chips_per_node else self.dcn_bw


def load_hardware(path: Traversable) -> dict[str, HardwareSpec]:
    """The rows of a hardware table (data/hardware.toml) as specs, each row checked."""
    fields = {f: float for f in ("peak_flops", "hbm_bytes", "hbm_bw", "ici_bw", "dcn_bw")}
    specs = {}
    for name, entry in tables.read(path).items():
        row = tables.check_row(path, name, entry, {**fields, "chips_per_node": int}, ())
        try:
            specs[name] = HardwareSpec(name, **row)
        except ValueError as e:
            raise ValueError(f"{path}: row {e}") from None
    return specs


HARDWARE: Mapping[str, HardwareSpec] = load_hardware(tables.DATA / "hardware.toml")

CPU_NAME = "cpu"


def get_hardware(name: str, *, measure: Callable[[], HardwareSpec] | None = None) -> HardwareSpec:
    """A table entry by name, or the measured local CPU for "cpu"."""
    if name == CPU_NAME:
        return (measure or local_cpu)()
    try:
        return HARDWARE[name]
    except KeyError:
        raise ValueError(
            f"unknown hardware preset {name!r}; valid: {sorted([*HARDWARE, CPU_NAME])}"
        ) from None


def cache_dir() -> str:
    return os.environ.get("JAXRL_CACHE_DIR") or os.path.join(
        os.path.expanduser("~"), ".cache", "jaxrl")


def _best_time(fn: Callable[[], object], repeats: int) -> float:
    fn()  # warm up
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def measure_cpu(matmul_n: int = 1024, copy_bytes: int = 256 << 20, repeats: int = 5) -> dict:
    """Best-of-`repeats` float32 matmul FLOP/s and memory copy bandwidth (read + write)."""
    rng = np.random.default_rng(0)
    a = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32)
    b = rng.standard_normal((matmul_n, matmul_n), dtype=np.float32)
    flops = 2 * matmul_n**3 / _best_time(lambda: a @ b, repeats)
    src = np.ones(copy_bytes // 4, dtype=np.float32)
    dst = np.empty_like(src)
    bw = 2 * src.nbytes / _best_time(lambda: np.copyto(dst, src), repeats)
    try:
        mem = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        mem = 8e9
    return {"peak_flops": flops, "mem_bw": bw, "mem_bytes": float(mem),
            "cores": os.cpu_count() or 1, "matmul_n": matmul_n, "copy_bytes": copy_bytes,
            "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "machine": f"{platform.machine()} {platform.processor() or ''}".strip()}


def local_cpu(*, refresh: bool = False, path: str | None = None) -> HardwareSpec:
    """The local CPU as one "chip": measured once, cached as JSON, re-measured on `refresh`."""
    path = path or os.path.join(cache_dir(), "cpu_hardware.json")
    m = None
    if not refresh and os.path.exists(path):
        with open(path) as f:
            m = json.load(f)
    if m is None:
        m = measure_cpu()
        os.makedirs(os.path.dirname(path), exist_ok=True)
        tmp = f"{path}.{os.getpid()}.tmp"
        with open(tmp, "w") as f:
            json.dump(m, f, indent=1)
        os.replace(tmp, path)
    return HardwareSpec(
        CPU_NAME, peak_flops=m["peak_flops"], hbm_bytes=m["mem_bytes"], hbm_bw=m["mem_bw"],
        ici_bw=m["mem_bw"], dcn_bw=m["mem_bw"], chips_per_node=1, date=m["measured_at"][:10],
        source=f"measured {m['measured_at']} on {m['machine']} ({m['cores']} cores): float32 "
               f"numpy matmul n={m['matmul_n']}, memory copy of {m['copy_bytes']} bytes; "
               f"cached at {path}")
