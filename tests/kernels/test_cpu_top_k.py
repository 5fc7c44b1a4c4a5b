"""The CPU top-k custom call against `lax.top_k`: values and indices, ties included."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from jaxrl_kernels import cpu_top_k

pytestmark = pytest.mark.skipif(not cpu_top_k.available(),
                                reason="no C++ compiler: the CPU kernel is not built here")


def _rows(kind, shape, rng):
    if kind == "normal":
        return rng.normal(size=shape)
    if kind == "ties":  # three values: the lower index must win among equals
        return rng.integers(0, 3, shape)
    if kind == "ascending":  # every entry raises the floor: the most cuts
        return np.sort(rng.normal(size=shape), axis=-1)
    if kind == "padded":  # -inf padding, as the sampler's blocks have, and few finite entries
        x = np.full(shape, -np.inf)
        x[:, ::37] = rng.normal(size=x[:, ::37].shape)
        return x
    raise ValueError(kind)


@pytest.mark.parametrize("kind", ["normal", "ties", "ascending", "padded"])
@pytest.mark.parametrize("shape,k", [((128, 1000), 64), ((9, 2048), 64), ((3, 70), 70),
                                     ((5, 100), 1), ((17, 300), 7)])
def test_top_k_equals_lax_top_k(kind, shape, k):
    x = jnp.asarray(_rows(kind, shape, np.random.default_rng(k)), jnp.float32)
    values, indices = jax.jit(cpu_top_k.top_k, static_argnums=1)(x, k)
    want_values, want_indices = jax.lax.top_k(x, k)
    np.testing.assert_array_equal(np.asarray(values), np.asarray(want_values))
    np.testing.assert_array_equal(np.asarray(indices), np.asarray(want_indices))


def test_bad_arguments_name_the_valid_ones():
    with pytest.raises(ValueError, match=r"x \[B, N\] and 1 <= k <= N; got \(2, 5\) and k=6"):
        cpu_top_k.top_k(jnp.zeros((2, 5)), 6)
    with pytest.raises(ValueError, match="got \\(5,\\)"):
        cpu_top_k.top_k(jnp.zeros((5,)), 2)


def test_a_cpu_engine_sampler_uses_it_and_samples_the_same_tokens():
    """`top_candidates` inside a one-device CPU engine's trace (`lowp_dots.cpu_kernels()`) calls
    the kernel and finds the same candidates as outside it (`lax.top_k`)."""
    from jaxrl.generate.sampling import top_candidates
    from jaxrl.models import lowp_dots
    x = jnp.asarray(np.random.default_rng(3).normal(size=(32000, 16)), jnp.float32)

    def find(x):
        return top_candidates(x, 64, vocab_major=True)

    plain = jax.jit(find)
    with lowp_dots.wide_results(True, kernels=True):  # an engine on one CPU device
        wide = jax.jit(find)
        hlo = wide.lower(x).as_text()
        got = wide(x)
    assert hlo.count(cpu_top_k.ops.TARGET) == 2
    for g, w in zip(got, plain(x), strict=True):
        np.testing.assert_array_equal(np.asarray(g), np.asarray(w))
