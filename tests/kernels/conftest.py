"""Kernel tests run each body on CPU: the TPU (Mosaic) body under the TPU interpreter
(``pltpu.InterpretParams()``, which simulates DMAs and semaphores and raises on out-of-bounds reads
or a missing DMA wait) and the GPU (Triton) body under Pallas' generic interpreter.

With ``JAXRL_KERNEL_TESTS=compiled`` (and ``JAX_PLATFORMS`` naming the accelerator, since
tests/conftest.py defaults it to cpu) the same tests run the body of the running accelerator
compiled instead (``interpret=False``), as launch/device_check.py does on a GPU. Asked for on a
CPU backend, every such test fails rather than silently interpreting."""

import os

import jax
import pytest
from jax.experimental.pallas import tpu as pltpu

COMPILED = os.environ.get("JAXRL_KERNEL_TESTS", "interpret") == "compiled"


@pytest.fixture(params=["compiled"] if COMPILED else ["tpu", "gpu"])
def interpret(request):
    """The ``interpret`` argument that selects (and runs on CPU) one kernel body."""
    if request.param == "compiled":
        if jax.default_backend() not in ("gpu", "tpu"):
            pytest.fail(f"JAXRL_KERNEL_TESTS=compiled needs a GPU or TPU backend; this one is "
                        f"{jax.default_backend()!r} (set JAX_PLATFORMS=cuda or tpu)")
        yield False
    elif request.param == "tpu":
        yield pltpu.InterpretParams()
        pltpu.reset_tpu_interpret_mode_state()
    else:
        yield True
