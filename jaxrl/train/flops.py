"""Model FLOPs and the running backend's peak FLOP/s, for `train/mfu`.

    train FLOPs per token = 6 * N_matmul + 12 * L * H * D * T          (PaLM, Chowdhery et al.
                                                                        2022, appendix B)

N_matmul counts every weight that takes part in a matmul: all layer weights plus the lm head
(V * E; with tied embeddings the table is counted once, as the head -- the input lookup is not a
matmul). The attention term counts QK^T and AV over the full T x T score matrix, forward and
backward. Peak FLOP/s: datasheet dense bf16 figures for GPU/TPU, a measured f32 matmul peak for
CPU, measured once per machine and cached in ~/.cache/jaxrl/peak_flops.json (the best seen;
`peak_flops(refresh=True)` measures again).
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from jaxrl.config import ModelConfig

# Dense bf16 peak FLOP/s per chip, from vendor datasheets (no sparsity).
DATASHEET_PEAK = {
    "H100": 989e12,
    "H200": 989e12,
    "B200": 2250e12,
    "A100": 312e12,
    "L4": 121e12,
    "TPU v4": 275e12,
    "TPU v5 lite": 197e12,
    "TPU v5e": 197e12,
    "TPU v5p": 459e12,
    "TPU v6 lite": 918e12,
    "TPU v6e": 918e12,
}

CACHE = Path(os.environ.get("JAXRL_CACHE", Path.home() / ".cache" / "jaxrl")) / "peak_flops.json"


def matmul_params(cfg: ModelConfig) -> int:
    """Weights that take part in a matmul for one token: layers (without norm scales; of a
    mixture of experts the router and the `experts_per_token` experts it picks) + the lm head."""
    return cfg.num_params(include_embeddings=False, active=True) + cfg.vocab_size * cfg.hidden_size


def train_flops_per_token(cfg: ModelConfig, seq_len: int) -> float:
    attn = 12 * cfg.num_layers * cfg.num_heads * cfg.head_size * seq_len
    return 6.0 * matmul_params(cfg) + attn


def _machine_key(device) -> str:
    return f"{device.platform}|{device.device_kind}|{platform.processor()}|{os.cpu_count()}"


def measure_cpu_matmul_peak(n: int = 2048, repeats: int = 5) -> float:
    """Best-of-`repeats` f32 [n, n] @ [n, n] rate on the default CPU device (FLOP/s)."""
    import jax
    import jax.numpy as jnp

    a = jax.random.normal(jax.random.key(0), (n, n), jnp.float32)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.float32)
    f = jax.jit(lambda x, y: jnp.dot(x, y, precision="highest"))
    f(a, b).block_until_ready()
    best = float("inf")
    for _ in range(repeats):
        t0 = time.perf_counter()
        f(a, b).block_until_ready()
        best = min(best, time.perf_counter() - t0)
    return 2.0 * n**3 / best


def peak_flops(device=None, *, refresh: bool = False) -> float:
    """Peak FLOP/s of one device of the running backend (see module docstring)."""
    import jax

    device = device or jax.devices()[0]
    if device.platform != "cpu":
        for name, peak in DATASHEET_PEAK.items():
            if name.lower() in device.device_kind.lower():
                return peak
        raise ValueError(
            f"no datasheet peak for device kind {device.device_kind!r}; known: "
            f"{sorted(DATASHEET_PEAK)} (add it to jaxrl/train/flops.py)"
        )
    key = _machine_key(device)
    cache = {}
    if CACHE.exists():
        try:
            cache = json.loads(CACHE.read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    if key in cache and not refresh:
        return float(cache[key])
    # a peak is a maximum: a measurement taken while other work shares the cores only
    # underestimates it, so the cache keeps the best seen on this machine.
    peak = max(measure_cpu_matmul_peak(), float(cache.get(key, 0.0)))
    cache[key] = peak
    try:
        CACHE.parent.mkdir(parents=True, exist_ok=True)
        tmp = CACHE.with_suffix(".tmp")
        tmp.write_text(json.dumps(cache, indent=1))
        tmp.replace(CACHE)
    except OSError:
        pass  # a read-only home only costs a re-measure next time
    return peak


def mfu(flops: float, seconds: float, peak_per_device: float, num_devices: int) -> float:
    return flops / max(seconds, 1e-12) / (peak_per_device * num_devices)
