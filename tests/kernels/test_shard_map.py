"""The ops inside jax.shard_map (check_vma on): how the model calls them on a dp x tp mesh, since a
pallas_call has no SPMD partitioning rule. Batch over "dp", kv heads (and their query heads) over
"tp"; the result and the flash gradient equal the unsharded reference."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from kernel_testing import GRAD_TOLERANCES, TOLERANCES, assert_close

import jaxrl_kernels
from jaxrl_kernels.decode_attention import decode_attention_reference
from jaxrl_kernels.flash_attention import BlockSizes, flash_attention_reference


def _mesh():
    return Mesh(np.asarray(jax.devices()[:4]).reshape(2, 2), ("dp", "tp"))


def test_flash_and_decode_under_shard_map():
    mesh = _mesh()
    B, T, Hq, Hkv, D = 2, 24, 8, 2, 16
    kq, kk, kv = jax.random.split(jax.random.key(0), 3)
    seq = P("dp", None, "tp", None)
    put = lambda x, spec: jax.device_put(x, NamedSharding(mesh, spec))
    q = put(jax.random.normal(kq, (B, T, Hq, D)), seq)
    k = put(jax.random.normal(kk, (B, T, Hkv, D)), seq)
    v = put(jax.random.normal(kv, (B, T, Hkv, D)), seq)
    flash = jax.shard_map(
        functools.partial(
            jaxrl_kernels.flash_attention, block_sizes=BlockSizes(block_q=16, block_k=16)
        ),
        mesh=mesh,
        in_specs=(seq, seq, seq),
        out_specs=seq,
    )
    assert_close(jax.jit(flash)(q, k, v), flash_attention_reference(q, k, v), "float32")
    loss = lambda fn: jax.jit(jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=(0, 1, 2)))
    for g, r in zip(loss(flash)(q, k, v), loss(flash_attention_reference)(q, k, v), strict=True):
        assert_close(g, r, "float32", GRAD_TOLERANCES)

    lengths = put(jnp.asarray([1, 19], jnp.int32), P("dp"))
    # check_vma=False: under vma checks, Pallas' generic interpreter (jax 0.10.2) rejects a
    # dynamic_slice of the "dp"-varying lengths by grid indices; compiled lowerings do not run it.
    decode = jax.shard_map(
        jaxrl_kernels.decode_attention,
        mesh=mesh,
        in_specs=(P("dp", "tp", None), seq, seq, P("dp")),
        out_specs=P("dp", "tp", None),
        check_vma=False,
    )
    want = decode_attention_reference(q[:, 0], k, v, lengths)
    assert_close(jax.jit(decode)(q[:, 0], k, v, lengths), want, "float32", TOLERANCES)
