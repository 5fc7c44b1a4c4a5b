"""Each body (forward and backward) lowers for its real target from this CPU machine (jax.export
cross-lowering): the GPU bodies through Pallas' Triton lowering to Triton IR, the TPU bodies to
Mosaic. Nothing runs; this catches ops or shapes a lowering rejects, which the interpreters cannot
(realistic shapes: bf16, D = 128, GQA 4, lengths not multiples of the blocks, default blocks)."""

import contextlib

import jax
import jax.numpy as jnp
import pytest
from jax import export

from jaxrl_kernels.decode_attention import ops as decode_ops
from jaxrl_kernels.decode_attention.kernel import decode_tpu
from jaxrl_kernels.decode_attention.kernel_gpu import decode_gpu
from jaxrl_kernels.flash_attention import ops as flash_ops
from jaxrl_kernels.paged_decode_attention import ops as paged_ops
from jaxrl_kernels.paged_decode_attention.kernel import paged_decode_tpu
from jaxrl_kernels.paged_decode_attention.kernel_gpu import paged_decode_gpu

PLATFORMS = {"gpu": ("cuda", "__gpu$xla.gpu.triton"), "tpu": ("tpu", "tpu_custom_call")}
B, T, HQ, HKV, D, S = 2, 1000, 32, 8, 128, 4000
WINDOW = 300  # a sliding window that is not a multiple of any block
SOFTCAP = 50.0  # Gemma 2's attn_logit_softcapping
BF16 = jnp.bfloat16


def _target(backend):
    """The device the GPU bodies lower for: an H100 (sm_90) named on an abstract mesh. jax 0.11's
    Pallas Triton lowering takes the compute capability from the device kind and, with no GPU
    attached, from an abstract device only; jax 0.10's lowered without one (and ignores it)."""
    if backend != "gpu":
        return contextlib.nullcontext()
    device = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=None, platform="gpu")
    return jax.sharding.use_abstract_mesh(
        jax.sharding.AbstractMesh((1,), ("x",), abstract_device=device))


def _lower(backend, fn, *args, softcap=None):
    platform, target = PLATFORMS[backend]
    with _target(backend):
        exported = export.export(
            jax.jit(fn),
            platforms=[platform],
            disabled_checks=[export.DisabledSafetyCheck.custom_call(target)],
        )(*args)
    module = exported.mlir_module()
    assert target in module
    if backend == "gpu":  # the Triton IR names its libdevice calls: tanh only under a soft cap
        assert ("__nv_tanhf" in module) == (softcap is not None)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "causal,segments,window,softcap",
    [
        (True, False, None, None),
        (True, True, None, None),
        (False, False, None, None),
        (True, True, WINDOW, None),
        (True, True, WINDOW, SOFTCAP),
    ],
)
def test_flash_attention_lowers(backend, causal, segments, window, softcap):
    q = jax.ShapeDtypeStruct((B, T, HQ, D), BF16)
    kv = jax.ShapeDtypeStruct((B, T, HKV, D), BF16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32) if segments else None
    cfg = flash_ops._Config(
        causal, D**-0.5, flash_ops.BlockSizes(), False, backend, window, softcap
    )
    _lower(
        backend,
        lambda q, k, v, s: flash_ops._forward(q, k, v, s, cfg),
        q,
        kv,
        kv,
        seg,
        softcap=softcap,
    )


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize(
    "segments,window,softcap",
    [(False, None, None), (True, None, None), (True, WINDOW, None), (True, WINDOW, SOFTCAP)],
)
def test_flash_attention_backward_lowers(backend, segments, window, softcap):
    q = jax.ShapeDtypeStruct((B, T, HQ, D), BF16)
    kv = jax.ShapeDtypeStruct((B, T, HKV, D), BF16)
    seg = jax.ShapeDtypeStruct((B, T), jnp.int32) if segments else None
    lse = jax.ShapeDtypeStruct((B, HKV, T * HQ // HKV), jnp.float32)
    cfg = flash_ops._Config(
        True, D**-0.5, flash_ops.BlockSizes(), False, backend, window, softcap
    )
    backward = flash_ops._backward_gpu if backend == "gpu" else flash_ops._backward_tpu

    def fn(q, k, v, s, o, lse, do):
        return backward(q, k, v, s, o, lse, do, cfg)

    _lower(backend, fn, q, kv, kv, seg, q, lse, q, softcap=softcap)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("window,softcap", [(None, None), (WINDOW, None), (WINDOW, SOFTCAP)])
def test_decode_attention_lowers(backend, window, softcap):
    q = jax.ShapeDtypeStruct((B, HQ, D), BF16)
    cache = jax.ShapeDtypeStruct((B, S, HKV, D), BF16)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    bs = decode_ops.BlockSizes().resolve(backend, B, HKV, S).fit_window(S, window)
    kw = dict(
        sm_scale=0.1,
        block_k=bs.block_k,
        num_splits=bs.num_splits,
        interpret=False,
        window=window,
        softcap=softcap,
    )

    def fn(q, k, v, n):
        return decode_ops.run_split_k(
            q,
            HKV,
            0.1,
            backend,
            lambda q4: decode_tpu(q4, k, v, n, **kw),
            lambda q4: decode_gpu(q4, k, v, n, num_warps=4, num_stages=3, **kw),
        )

    _lower(backend, fn, q, cache, cache, lengths, softcap=softcap)


@pytest.mark.parametrize("backend", ["gpu", "tpu"])
@pytest.mark.parametrize("window,softcap", [(None, None), (WINDOW, None), (WINDOW, SOFTCAP)])
def test_paged_decode_attention_lowers(backend, window, softcap):
    q = jax.ShapeDtypeStruct((B, HQ, D), BF16)
    pages = jax.ShapeDtypeStruct((300, 64, HKV, D), BF16)
    lengths = jax.ShapeDtypeStruct((B,), jnp.int32)
    table = jax.ShapeDtypeStruct((B, 63), jnp.int32)
    bs = paged_ops.BlockSizes().resolve(backend, B, HKV, 63)
    kw = dict(
        sm_scale=0.1, num_splits=bs.num_splits, interpret=False, window=window, softcap=softcap
    )

    def fn(q, k, v, n, t):
        return decode_ops.run_split_k(
            q,
            HKV,
            0.1,
            backend,
            lambda q4: paged_decode_tpu(q4, k, v, n, t, **kw),
            lambda q4: paged_decode_gpu(q4, k, v, n, t, num_warps=4, num_stages=3, **kw),
        )

    _lower(backend, fn, q, pages, pages, lengths, table, softcap=softcap)
