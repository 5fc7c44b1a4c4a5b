"""`generate.debug_chunk_delay_s`, the artificially slow generator of tests and benchmarks: each
decode chunk sleeps the delay (split among the generator mesh's devices), and the delay does not
change what is generated."""

import types

import pytest

from jaxrl.config import ConfigError, GenerateConfig
from jaxrl.generate import JaxEngine, SamplingParams, Scheduler
from jaxrl.generate import engine as engine_mod
from jaxrl.models import create_model
from jaxrl.sharding import make_meshes
from jaxrl.testing import tiny_model_config


def _tokens(engine):
    sched = Scheduler(engine)
    sched.submit([1, 2, 3], SamplingParams(max_tokens=9, temperature=0.0, n=2))
    return [c.tokens for c in sorted(sched.run(), key=lambda c: c.sample_index)]


def test_each_chunk_sleeps_the_delay_and_generates_the_same_tokens(monkeypatch):
    engine = JaxEngine(create_model(tiny_model_config(), seed=0), num_slots=2, max_len=32,
                       chunk_steps=4)  # one engine, the delay set on it: compiled once
    slept = []
    # only the engine module's `time` is replaced: the process's `time.sleep` stays real, since
    # other code on this thread sleeps too (filelock polls jax's compilation-cache lock while
    # another test process holds it, which once failed this test with 1,270 recorded polls)
    monkeypatch.setattr(engine_mod, "time", types.SimpleNamespace(sleep=slept.append))
    want = _tokens(engine)
    assert slept == []  # no delay configured: no sleep at all
    engine.debug_delay_s = 0.125
    assert _tokens(engine) == want
    # 9 new tokens, the first drawn at insert: 8 decode steps in chunks of 4
    assert slept == [0.125, 0.125]


def test_from_config_splits_the_delay_among_the_generator_devices():
    from jaxrl.config import MeshConfig

    mesh = make_meshes(MeshConfig(trainer=(4, 1), generator=(2, 2))).generator
    cfg = GenerateConfig(num_slots=2, max_len=32, debug_chunk_delay_s=1.0)
    engine = JaxEngine.from_config(create_model(tiny_model_config(), seed=0), cfg, mesh=mesh)
    assert engine.debug_delay_s == 0.25


@pytest.mark.parametrize("bad", [-0.1, float("nan"), float("inf")])
def test_a_negative_or_non_finite_delay_is_refused(bad):
    with pytest.raises(ConfigError, match="debug_chunk_delay_s.*>= 0"):
        GenerateConfig(debug_chunk_delay_s=bad)
    if bad < 0:
        with pytest.raises(ValueError, match="debug_delay_s must be >= 0"):
            JaxEngine(create_model(tiny_model_config(), seed=0), num_slots=1, max_len=8,
                      debug_delay_s=bad)
