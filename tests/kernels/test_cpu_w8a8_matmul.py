"""The CPU w8a8 matmul custom call against quant.py's XLA form, bit for bit."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl.models import lowp_dots, quant
from jaxrl_kernels import cpu_w8a8_matmul as w8
from jaxrl_kernels.cpu_w8a8_matmul import ops

pytestmark = pytest.mark.skipif(not w8.available(),
                                reason="no C++ compiler or no AVX512 VNNI: the kernel is not built")


def _case(rng, m, k, n, dtype):
    x = jnp.asarray(rng.normal(size=(m, k)) * 3.0, dtype)
    x = x.at[0].set(0.0)  # an all-zero row: scale 1, output 0
    q, scale = quant.quantize_weight(jnp.asarray(rng.normal(size=(k, n)), jnp.float32), 1)
    return x, q, scale


@pytest.mark.parametrize("dtype", [jnp.bfloat16, jnp.float32])
@pytest.mark.parametrize("m,k,n", [(32, 512, 1536), (13, 96, 80), (7, 16, 48), (1, 64, 16),
                                   (130, 160, 208), (6, 1536, 64)])
def test_the_kernel_equals_the_xla_form_bit_for_bit(dtype, m, k, n):
    """Rows not a multiple of the 6-row tile, panels of 1 to 4 column blocks: the int32 sums are
    exact and the scales applied in the XLA form's order, so every output bit agrees."""
    x, q, scale = _case(np.random.default_rng(m + k + n), m, k, n, dtype)
    got = jax.jit(w8.w8a8_matmul)(x, q, scale)
    want = jax.jit(w8.w8a8_matmul_reference)(x, q, scale)
    assert got.dtype == want.dtype == jnp.dtype(dtype)
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(want, np.float32))
    assert not np.any(np.asarray(got[0], np.float32))
    # the reference is quant.py's own path, and both are near the unquantized product
    plain = np.asarray(x, np.float32) @ np.asarray(quant.dequantize(q, scale))
    assert np.max(np.abs(np.asarray(got, np.float32) - plain)) <= 0.05 * np.max(np.abs(plain))


@pytest.mark.parametrize("spec,xs,ws,n", [("bte,ef->btf", (2, 3, 64), (64, 48), 1),
                                          ("bthd,hde->bte", (2, 3, 4, 16), (4, 16, 32), 2),
                                          ("bte,ekd->btkd", (2, 5, 32), (32, 2, 16), 1)])
def test_a_one_device_engine_trace_calls_it_for_every_projection_form(spec, xs, ws, n):
    """`quantized_einsum` inside `wide_results(kernels=True)` (a one-device CPU engine's trace)
    is one custom call and equals the same einsum outside it (quant.py's XLA form)."""
    x = jax.random.normal(jax.random.key(1), xs, jnp.bfloat16) * 3
    q, scale = quant.quantize_weight(jax.random.normal(jax.random.key(2), ws), n, "w8a8")

    def project(a):
        return quant.quantized_einsum(spec, a, q, scale, "w8a8")

    plain = jax.jit(project)
    with lowp_dots.wide_results(True, kernels=True):
        fast = jax.jit(project)
        hlo = fast.lower(x).as_text()
        got = fast(x)
    assert hlo.count(ops.TARGET) == 1 and "xi32>" not in hlo
    assert got.shape == plain(x).shape
    np.testing.assert_array_equal(np.asarray(got, np.float32), np.asarray(plain(x), np.float32))
    with lowp_dots.wide_results(True, kernels=False):  # several devices: quant.py's XLA form
        assert ops.TARGET not in jax.jit(lambda a: project(a)).lower(x).as_text()


def test_shapes_it_does_not_take_stay_on_xla():
    assert w8.supports(512, 1536, jnp.bfloat16) and w8.supports(16, 16, "float32")
    assert not w8.supports(72, 64, jnp.bfloat16)  # K not a multiple of 16
    assert not w8.supports(64, 40, np.float32)  # N not a multiple of 16
    assert not w8.supports(64, 64, jnp.float16)
    x = jnp.ones((2, 3, 24), jnp.bfloat16)
    q, scale = quant.quantize_weight(jnp.ones((24, 16)), 1, "w8a8")
    with lowp_dots.wide_results(True, kernels=True):
        hlo = jax.jit(lambda a: quant.quantized_einsum("bte,ef->btf", a, q, scale, "w8a8")
                      ).lower(x).as_text()
    assert ops.TARGET not in hlo and "xi32>" in hlo


def test_bad_arguments_name_what_it_wants():
    x, q, scale = _case(np.random.default_rng(0), 4, 32, 16, jnp.float32)
    with pytest.raises(ValueError, match=r"x \[M, K\], q \[K, N\] int8 and scale \[N\]"):
        w8.w8a8_matmul(x, q.T, scale)
    with pytest.raises(ValueError, match=r"multiples of 16.*got K=24, N=16, float16"):
        w8.w8a8_matmul(jnp.ones((4, 24), jnp.float16), jnp.ones((24, 16), jnp.int8), scale)


@pytest.mark.parametrize("platform", ["cpu", "cuda"])
def test_a_w8a8_engine_calls_it_on_cpu_only(monkeypatch, platform):
    """A w8a8 engine's decode step on one CPU device runs every projection as the custom call;
    lowered for a GPU it keeps the int8 dot_general (no custom call)."""
    from jaxrl.generate import JaxEngine
    from jaxrl.models import create_model
    from jaxrl.presets import tiny_model_config

    cfg = tiny_model_config(attention_impl="xla", vocab_size=256)
    model = quant.quantized_copy(create_model(cfg, seed=0), "w8a8")
    monkeypatch.setattr(JaxEngine, "_platform", lambda self: "gpu" if platform == "cuda" else "cpu")
    engine = JaxEngine(model, num_slots=2, max_len=16, chunk_steps=2, prefill_buckets=[4])
    text = engine._chunk_fns[1].trace(engine.params, engine.init_decode_state(), np.int32(3)).lower(
        lowering_platforms=(platform,)).as_text()
    int8_dots = [line for line in text.splitlines() if "dot_general" in line and "xi8>" in line]
    if platform == "cpu":  # q, k, v, o, gate, up, down in every layer
        assert text.count(ops.TARGET) == 7 * cfg.num_layers and not int8_dots
    else:
        assert ops.TARGET not in text and len(int8_dots) == 7 * cfg.num_layers
