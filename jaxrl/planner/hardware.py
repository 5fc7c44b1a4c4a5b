"""Accelerator specs: a datasheet table for GPUs and TPUs, and a measured entry for the local CPU.

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

import numpy as np

GB = 1e9
GiB = 2**30
TB = 1e12


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


_NIC_400G = 400e9 / 8  # one ConnectX-7 400 Gb/s NIC per GPU on DGX H100/H200/B200

HARDWARE: Mapping[str, HardwareSpec] = {
    h.name: h
    for h in (
        HardwareSpec("h100", 989e12, 80 * GB, 3.35 * TB, 450 * GB, _NIC_400G, 8,
                     "NVIDIA H100 Tensor Core GPU datasheet (SXM5: BF16 1,979 TFLOPS with "
                     "sparsity, 80 GB HBM3, 3.35 TB/s, NVLink 900 GB/s bidirectional); DGX H100 "
                     "datasheet (8x ConnectX-7 400 Gb/s)"),
        HardwareSpec("h200", 989e12, 141 * GB, 4.8 * TB, 450 * GB, _NIC_400G, 8,
                     "NVIDIA H200 Tensor Core GPU datasheet (SXM: BF16 1,979 TFLOPS with "
                     "sparsity, 141 GB HBM3e, 4.8 TB/s, NVLink 900 GB/s bidirectional)"),
        HardwareSpec("b200", 2.25e15, 180 * GB, 8 * TB, 900 * GB, _NIC_400G, 8,
                     "NVIDIA HGX B200 / DGX B200 datasheets (per GPU: BF16 4.5 PFLOPS with "
                     "sparsity, 180 GB HBM3e, 8 TB/s, NVLink 5 1.8 TB/s bidirectional)"),
        HardwareSpec("tpu-v5e", 197e12, 16 * GB, 819 * GB, 1600e9 / 8, 1600e9 / 8, 256,
                     "Google Cloud TPU v5e documentation (197 TFLOP/s BF16, 16 GB HBM2, "
                     "819 GB/s, ICI 1,600 Gbps per chip, 256-chip pods)"),
        HardwareSpec("tpu-v5p", 459e12, 95 * GB, 2765 * GB, 4800e9 / 8, 4800e9 / 8, 256,
                     "Google Cloud TPU v5p documentation (459 TFLOP/s BF16, 95 GB HBM2e, "
                     "2,765 GB/s, ICI 4,800 Gbps per chip)"),
        HardwareSpec("tpu-v6e", 918e12, 32 * GB, 1640 * GB, 3584e9 / 8, 3584e9 / 8, 256,
                     "Google Cloud TPU v6e (Trillium) documentation (918 TFLOP/s BF16, 32 GB "
                     "HBM, 1,640 GB/s, ICI 3,584 Gbps per chip, 256-chip pods)"),
        # Alternate hardware (issue 27). Sources were read 2026-12-01; "vendor claim" marks a
        # figure only the vendor publishes (no independent measurement), "secondary" one read
        # from a third-party page quoting the vendor's datasheet. Figures not found are named.
        HardwareSpec("tpu7x", 2307e12, 192 * GiB, 7380 * GB, 1200 * GB / 2, 1200 * GB / 2, 256,
                     "Google Cloud TPU7x (Ironwood) documentation, "
                     "https://docs.cloud.google.com/tpu/docs/tpu7x (read 2026-12-01): 2,307 "
                     "TFLOP/s BF16, 192 GiB HBM, 7,380 GB/s, ICI 1,200 GB/s bidirectional per "
                     "chip, 9,216-chip pods; vendor claim. chips_per_node 256 as for v5p"),
        HardwareSpec("mi300x", 1307.4e12, 192 * GB, 5.3 * TB, 448 * GB, _NIC_400G, 8,
                     "AMD Instinct MI300X datasheet figures, secondary: "
                     "https://raw.githubusercontent.com/alpharomercoma/MI300X-vs-H200/"
                     "6077fdc7bfc215171c33435b7cd76ca4c5f2b236/METHODOLOGY.md (1,307.4 TFLOP/s "
                     "BF16 dense, 192 GB HBM3, 5.3 TB/s) and https://gpu.blog/gpus/"
                     "instinct-mi300x-mi300x (2025-01-01: Infinity Fabric 896 GB/s, 8 GPUs per "
                     "node); read 2026-12-01; vendor claims. Scale-out: a 400 Gb/s NIC per GPU "
                     "assumed (no published figure found)"),
        HardwareSpec("mi325x", 1307.4e12, 256 * GB, 6 * TB, 448 * GB, _NIC_400G, 8,
                     "AMD Instinct MI325X datasheet figures, secondary: https://awesomeagents.ai/hardware/"
                     "amd-mi325x and https://wiaix.com/amd-instincttm-mi325x-accelerators (read "
                     "2026-12-01: 1,307.4 TFLOP/s BF16 dense, 256 GB HBM3E, 6 TB/s, drop-in for "
                     "the MI300X platform); vendor claims. Infinity Fabric as MI300X (same "
                     "platform); scale-out: a 400 Gb/s NIC per GPU assumed (not found)"),
        HardwareSpec("gaudi3", 1835e12, 128 * GB, 3.7 * TB, 600 * GB, 200e9 / 8, 8,
                     "Intel Gaudi 3 datasheet figures, secondary: https://www.yobitel.com/knowledge-base/"
                     "intel-gaudi-3 and https://evokernel-specs.pages.dev/hardware/gaudi-3/ "
                     "(read 2026-12-01: 1,835 TFLOP/s BF16 matrix engines, 128 GB HBM2e, "
                     "3.7 TB/s, 24 x 200 GbE RoCE = 600 GB/s one direction, 200 Gb/s per card "
                     "out of the 8-card node); vendor claims (Intel)"),
        HardwareSpec("trn2", 667e12, 96 * GiB, 2.9 * TB, _NIC_400G, _NIC_400G, 16,
                     "AWS Neuron documentation, Trainium2 architecture, "
                     "https://awsdocs-neuron.readthedocs-hosted.com/en/latest/nki/arch/"
                     "trainium2_arch.html and .../about-neuron/arch/neuron-hardware/"
                     "trainium2.rst (read 2026-12-01: 667 BF16 TFLOP/s dense, 96 GiB, 2.9 TB/s; "
                     "16 chips per trn2.48xlarge); vendor claim. NeuronLink-v3 and EFA "
                     "bandwidth per chip not found: 400 Gb/s assumed for both"),
    )
}

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
        mem = 8 * GB
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
        ici_bw=m["mem_bw"], dcn_bw=m["mem_bw"], chips_per_node=1,
        source=f"measured {m['measured_at']} on {m['machine']} ({m['cores']} cores): float32 "
               f"numpy matmul n={m['matmul_n']}, memory copy of {m['copy_bytes']} bytes; "
               f"cached at {path}")
