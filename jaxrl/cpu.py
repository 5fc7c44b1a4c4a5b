"""CPU-only machines: how many simulated devices to split the host into."""

import os


def simulated_device_flags(count: int | None = None) -> str:
    """XLA flags giving `count` host devices (default: 2, one for each role).

    Only meaningful before JAX initialises its backends; a real accelerator ignores it.
    """
    count = count or int(os.environ.get("JAXRL_CPU_DEVICES", "2"))
    return f"--xla_force_host_platform_device_count={count}"
