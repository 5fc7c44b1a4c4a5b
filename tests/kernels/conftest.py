"""Kernel tests run each body on CPU: the TPU (Mosaic) body under the TPU interpreter
(``pltpu.InterpretParams()``, which simulates DMAs and semaphores and raises on out-of-bounds reads
or a missing DMA wait) and the GPU (Triton) body under Pallas' generic interpreter."""

import pytest
from jax.experimental.pallas import tpu as pltpu


@pytest.fixture(params=["tpu", "gpu"])
def interpret(request):
    """The ``interpret`` argument that selects (and runs on CPU) one kernel body."""
    if request.param == "tpu":
        yield pltpu.InterpretParams()
        pltpu.reset_tpu_interpret_mode_state()
    else:
        yield True
