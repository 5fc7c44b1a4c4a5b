"""The CPU decode-attention custom call against its pure-jnp reference and the engine's XLA path."""

import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models.attention import cached_attention
from jaxrl_kernels import _cpu_build
from jaxrl_kernels import cpu_decode_attention as cda
from jaxrl_kernels.cpu_decode_attention import ops

pytestmark = pytest.mark.skipif(not cda.available(),
                                reason="no C++ compiler: the CPU kernel is not built here")


def _case(rng, dtype, b, hkv, g, d, s):
    arr = lambda *shape: jnp.asarray(rng.normal(size=shape), dtype)
    return (arr(b, hkv * g, d), arr(b, hkv, d), arr(b, hkv, d), arr(b, hkv, d, s),
            arr(b, hkv, s, d))


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("shape", [(5, 2, 4, 64, 37), (3, 1, 7, 128, 64), (4, 3, 1, 16, 20),
                                   (9, 2, 5, 80, 16)])
def test_the_kernel_writes_and_attends_as_its_reference(dtype, shape):
    """Slots and lengths out of range included (-1, S, S + 2; n = 0): a slot is clamped into the
    cache as the XLA select clamps it, and a row attends to at least one entry."""
    rng = np.random.default_rng(sum(shape))
    q, kn, vn, kc, vc = _case(rng, dtype, *shape)
    b, s = shape[0], shape[-1]
    slot = jnp.asarray(rng.integers(-1, s + 3, b), jnp.int32)
    n = jnp.asarray(rng.integers(0, s + 3, b), jnp.int32)
    got = jax.jit(cda.write_and_attend, static_argnums=7)(q, kn, vn, kc, vc, slot, n, 0.3)
    want = cda.write_and_attend_reference(q, kn, vn, kc, vc, slot, n, 0.3)
    tol = 2e-2 if dtype == jnp.bfloat16 else 2e-6
    np.testing.assert_allclose(np.float32(got[0]), np.float32(want[0]), atol=tol, rtol=tol)
    for g, w in zip(got[1:], want[1:], strict=True):  # the writes are exact
        np.testing.assert_array_equal(np.float32(g), np.float32(w))


def test_the_kernel_equals_the_xla_decode_attention_it_replaces():
    """The same step as `cached_attention` over the heads-major cache after a select write,
    the engine's path without the kernel: one query a row at position length - 1."""
    rng = np.random.default_rng(0)
    b, hkv, g, d, s = 6, 2, 4, 64, 48
    q, kn, vn, kc, vc = _case(rng, jnp.float32, b, hkv, g, d, s)
    lengths = jnp.asarray(rng.integers(0, s, b), jnp.int32)  # before the write
    out, k, v = cda.write_and_attend(q, kn, vn, kc, vc, lengths, lengths + 1, d ** -0.5)
    _, k_ref, v_ref = cda.write_and_attend_reference(q, kn, vn, kc, vc, lengths, lengths + 1,
                                                     1.0)
    want = cached_attention(q[:, None], k_ref, v_ref, lengths[:, None], lengths + 1,
                            heads_major=True)[:, 0]
    np.testing.assert_allclose(np.asarray(out), np.asarray(want), atol=2e-6, rtol=2e-6)


def test_a_cpu_engine_step_compiles_one_call_a_layer_and_no_cache_copy():
    """The caches are aliased to the call's results, so XLA neither selects over nor copies a
    whole cache in the step."""
    rng = np.random.default_rng(1)
    q, kn, vn, kc, vc = _case(rng, jnp.bfloat16, 4, 2, 4, 64, 32)
    lengths = jnp.zeros((4,), jnp.int32)

    def two_layers(q, kn, vn, kc, vc, lengths):
        for _ in range(2):
            out, kc, vc = cda.write_and_attend(q, kn, vn, kc, vc, lengths, lengths + 1, 0.125)
            q = out
        return q, kc, vc

    hlo = jax.jit(two_layers, donate_argnums=(3, 4)).lower(
        q, kn, vn, kc, vc, lengths).compile().as_text()
    assert hlo.count(f'custom_call_target="{ops.TARGET}"') == 2
    assert "bf16[4,2,64,32]{3,2,1,0} copy(" not in hlo
    assert "select" not in hlo.split("ENTRY")[-1]


def test_bad_shapes_name_what_the_kernel_wants():
    rng = np.random.default_rng(2)
    q, kn, vn, kc, vc = _case(rng, jnp.float32, 2, 2, 2, 32, 8)
    with pytest.raises(ValueError, match=r"\[B, K, D, S\] and \[B, K, S, D\]"):
        cda.write_and_attend(q, kn, vn, kc.transpose(0, 1, 3, 2), vc, jnp.zeros(2, jnp.int32),
                             jnp.ones(2, jnp.int32), 1.0)


def test_unsupported_heads_and_dtypes_are_left_to_xla():
    assert cda.supports(64, jnp.bfloat16) and cda.supports(128, np.float32)
    assert cda.supports(80, "bfloat16")
    assert not cda.supports(72, jnp.bfloat16)  # not a multiple of 16
    assert not cda.supports(64, jnp.float16)


def test_without_a_compiler_the_build_says_why_and_the_step_keeps_xla(monkeypatch, tmp_path):
    monkeypatch.setenv("CXX", str(tmp_path / "no-such-compiler"))
    monkeypatch.setenv("JAXRL_KERNEL_CACHE", str(tmp_path / "cache"))
    _cpu_build.library_path.cache_clear()
    try:
        with pytest.warns(UserWarning, match="no-such-compiler.*stays on XLA"):
            assert _cpu_build.library_path(ops.SOURCE) is None
    finally:
        _cpu_build.library_path.cache_clear()  # the next caller finds the real build again


def test_a_build_is_cached_by_its_inputs(monkeypatch, tmp_path):
    """A second process (here: a cleared cache) reuses the file instead of compiling again."""
    monkeypatch.setenv("JAXRL_KERNEL_CACHE", str(tmp_path))
    _cpu_build.library_path.cache_clear()
    try:
        first = _cpu_build.library_path(ops.SOURCE)
        assert first is not None and first.startswith(str(tmp_path))
        stamp = os.stat(first).st_mtime_ns
        _cpu_build.library_path.cache_clear()
        assert _cpu_build.library_path(ops.SOURCE) == first
        assert os.stat(first).st_mtime_ns == stamp
    finally:
        _cpu_build.library_path.cache_clear()


def test_a_first_call_registers_the_kernel_itself():
    """In a fresh process, calling the op (not `available()` first) builds and registers it."""
    import subprocess
    import sys
    code = ("import jax.numpy as jnp\n"
            "from jaxrl_kernels.cpu_decode_attention import write_and_attend\n"
            "z = jnp.zeros\n"
            "out, k, v = write_and_attend(z((1, 2, 16)), z((1, 1, 16)), z((1, 1, 16)),\n"
            "    z((1, 1, 16, 4)), z((1, 1, 4, 16)), z(1, 'int32'), z(1, 'int32') + 1, 1.0)\n"
            "print(out.shape)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.strip() == "(1, 2, 16)"


@pytest.mark.parametrize("devices", [1, 4])
def test_an_engine_calls_the_cpu_kernels_only_on_one_device(devices):
    """Neither kernel has a sharding rule: over several devices XLA would gather a whole cache
    a layer and run each call whole on every device, so an engine with a multi-device mesh
    keeps its XLA step (and its sharded attention)."""
    from jaxrl.generate.engine import JaxEngine
    from jaxrl.models.model import create_model
    from jaxrl.presets import tiny_model_config
    from jaxrl.sharding import make_mesh
    from jaxrl_kernels import cpu_top_k

    mesh = make_mesh((devices, 1), "generator", jax.devices()[:devices])
    cfg = tiny_model_config(attention_impl="xla", dtype="bfloat16", param_dtype="bfloat16",
                            vocab_size=512)
    engine = JaxEngine(create_model(cfg, seed=0), num_slots=4, max_len=16, chunk_steps=2,
                       mesh=mesh)
    state = engine.init_decode_state()
    hlo = engine._chunk_fns[1].lower(engine.params, state, np.int32(3)).as_text()
    calls = hlo.count(ops.TARGET), hlo.count(cpu_top_k.ops.TARGET)
    if devices == 1:  # one attention call a layer; the sampler's top-k in each of its paths
        assert calls[0] == cfg.num_layers and calls[1] >= 1, calls
    else:
        assert calls == (0, 0), calls
