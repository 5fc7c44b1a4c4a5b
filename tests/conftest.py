"""Test session set-up: a simulated 8-device CPU mesh, set once before JAX starts."""

import os

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

_ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _working_directory_survives(request):
    """In one full-suite run the session's working directory was gone (`os.getcwd()` raised
    FileNotFoundError) from some test on, and every later test that used it failed. After each
    test: if the directory is gone, say which test it was and go back to the repository root."""
    yield
    try:
        os.getcwd()
    except FileNotFoundError:
        print(f"\nworking directory gone after {request.node.nodeid}; back to {_ROOT}",
              file=sys.stderr)
        os.chdir(_ROOT)
