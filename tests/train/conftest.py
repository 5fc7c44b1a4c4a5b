"""Shared fixtures for the trainer tests: the tiny model, a trainer mesh, toy batches."""

import jax
import numpy as np
import pytest

from jaxrl.sharding import make_mesh
from jaxrl.testing import tiny_model_config
from jaxrl.train.batch import make_batch
from jaxrl.train.config import TrainConfig


@pytest.fixture(scope="session")
def model_cfg():
    return tiny_model_config()


@pytest.fixture(scope="session")
def mesh():
    """A 2x1 trainer mesh: sharded like the real thing, cheap to compile for."""
    return make_mesh((2, 1), "trainer", jax.devices()[:2])


@pytest.fixture(scope="session")
def train_cfg():
    """The one config most step tests share, so the jitted step compiles once per session."""
    return TrainConfig(lr=1e-2, logprob_chunk=8, weight_decay=0.0)


@pytest.fixture(scope="session")
def make_toy():
    return toy_batch


def toy_batch(seed=0, b=8, t=16, prompt=6, vocab=128, behaviour=False, ragged=True):
    """Random prompt+completion rows, 2 groups of b/2, right padded to t when `ragged`."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(0, vocab, (b, t))
    lengths = rng.integers(prompt + 2, t + 1, b) if ragged else np.full(b, t)
    pos = np.arange(t)[None, :]
    seg = (pos < lengths[:, None]).astype(np.int32)
    mask = ((pos >= prompt) & (pos < lengths[:, None])).astype(np.float32)
    kw = {}
    if behaviour:
        kw["behaviour_logprobs"] = (-np.abs(rng.normal(size=(b, t))) - 4.0) * mask
    return make_batch(
        tokens,
        mask,
        rng.random(b).round(1),
        np.repeat(np.arange(2), b // 2),
        segment_ids=seg,
        **kw,
    )
