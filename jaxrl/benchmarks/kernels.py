"""`python launch/bench.py kernels`: Pallas attention kernels against XLA and cuDNN.

Correctness first (each kernel against its jnp reference on the device), then:

* prefill: causal flash attention forward, T = 1k..8k, D = 128, GQA 4 (32 query / 8 kv heads),
  bf16, batch chosen so every T sees the same number of tokens. TFLOP/s (causal FLOPs =
  2 * B * Hq * T^2 * D) for the Pallas kernel, the XLA reference and cuDNN
  (`jax.nn.dot_product_attention(implementation="cudnn")`, GPU only), with the ratio to cuDNN.
* decode: one query token per row, batch 64..256, context 1k..8k, full-length rows. Achieved GB/s
  of KV read (2 * B * L * Hkv * D * bytes / time) for the Pallas kernel (contiguous and paged) and
  the XLA reference, against the device's measured copy bandwidth (read + write of a 4 GiB array).

With `--backward`, prefill also reports forward+backward TFLOP/s (3.5x the forward FLOPs) for each
implementation. Targets on an H100/H200: prefill >= 70% of cuDNN, decode >= 70% of the measured
copy bandwidth.
On CPU it refuses (figures would mean nothing) unless `--smoke`, which runs a tiny interpreted
configuration end to end.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time

import numpy as np

import jaxrl_kernels

PREFILL_T = (1024, 2048, 4096, 8192)
DECODE_BATCH = (64, 256)
DECODE_CONTEXT = (1024, 8192)
HQ, HKV, D = 32, 8, 128


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench.py kernels", description=__doc__.split("\n")[0])
    p.add_argument("--smoke", action="store_true", help="tiny interpreted run (works on CPU)")
    p.add_argument("--iters", type=int, default=20, help="timed calls per configuration")
    p.add_argument("--prefill-tokens", type=int, default=16384, help="B * T per prefill config")
    p.add_argument("--skip-xla", action="store_true", help="skip the XLA reference timings")
    p.add_argument(
        "--backward",
        action="store_true",
        help="also time prefill forward+backward (FLOPs: 3.5x the forward's)",
    )
    p.add_argument("--json", default=None, help="also write the results to this file")
    return p.parse_args(argv)


def _time_per_call(fn, *args, iters):
    """Median over 3 rounds of (iters back-to-back calls / iters); compile + warm-up excluded."""
    import jax

    jax.block_until_ready(fn(*args))
    rounds = []
    for _ in range(3):
        t0 = time.perf_counter()
        out = None
        for _ in range(iters):
            out = fn(*args)
        jax.block_until_ready(out)
        rounds.append((time.perf_counter() - t0) / iters)
    return statistics.median(rounds)


def _copy_bandwidth(iters):
    import jax
    import jax.numpy as jnp

    x = jnp.ones((1 << 31,), jnp.bfloat16)  # 4 GiB
    copy = jax.jit(lambda a: a + jnp.bfloat16(1))
    t = _time_per_call(copy, x, iters=iters)
    return 2 * x.size * x.dtype.itemsize / t / 1e9


def _check_correctness(interpret, dtype):
    """Each kernel against its reference on small shapes; returns a list of failures."""
    import jax
    import jax.numpy as jnp

    from jaxrl_kernels.decode_attention import decode_attention_reference
    from jaxrl_kernels.flash_attention import flash_attention_reference
    from jaxrl_kernels.paged_decode_attention import paged_decode_attention_reference

    failures = []
    ks = jax.random.split(jax.random.key(0), 3)
    B, T = 2, 200 if interpret else 1000
    d = 64 if interpret else D
    hq, hkv = (8, 2) if interpret else (HQ, HKV)
    q = jax.random.normal(ks[0], (B, T, hq, d), dtype)
    k = jax.random.normal(ks[1], (B, T, hkv, d), dtype)
    v = jax.random.normal(ks[2], (B, T, hkv, d), dtype)
    seg = jnp.asarray(np.repeat(np.arange(4), -(-T // 4))[None, :T].repeat(B, 0), jnp.int32)
    tol = 3e-2 if dtype == jnp.bfloat16 else 2e-5

    def check(name, got, want):
        err = float(jnp.max(jnp.abs(got.astype(jnp.float32) - want.astype(jnp.float32))))
        ok = err <= tol * (1 + float(jnp.max(jnp.abs(want.astype(jnp.float32)))))
        print(f"  correctness {name:<28} max|err| = {err:.2e}  {'ok' if ok else 'FAIL'}")
        if not ok:
            failures.append(name)

    check(
        "flash causal",
        jaxrl_kernels.flash_attention(q, k, v, interpret=interpret),
        flash_attention_reference(q, k, v),
    )
    check(
        "flash causal+segments",
        jaxrl_kernels.flash_attention(q, k, v, segment_ids=seg, interpret=interpret),
        flash_attention_reference(q, k, v, segment_ids=seg),
    )

    def grads(fn):
        loss = lambda q, k, v: jnp.sum(fn(q, k, v).astype(jnp.float32) ** 2)
        return jax.grad(loss, argnums=(0, 1, 2))(q, k, v)

    got = grads(lambda q, k, v: jaxrl_kernels.flash_attention(q, k, v, interpret=interpret))
    want = grads(flash_attention_reference)
    for name, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
        scale = jnp.max(jnp.abs(w.astype(jnp.float32)))
        check(f"flash backward {name} (relative)", g / scale, w / scale)
    lengths = jnp.asarray([1, T - 7], jnp.int32)
    check(
        "decode",
        jaxrl_kernels.decode_attention(q[:, 0], k, v, lengths, interpret=interpret),
        decode_attention_reference(q[:, 0], k, v, lengths),
    )
    ps = 16
    P = T // ps
    pages_k = k[:, : P * ps].reshape(B * P, ps, hkv, d)[::-1]
    pages_v = v[:, : P * ps].reshape(B * P, ps, hkv, d)[::-1]
    table = (B * P - 1 - jnp.arange(B * P, dtype=jnp.int32)).reshape(B, P)
    lengths = jnp.asarray([1, P * ps - 5], jnp.int32)
    check(
        "paged decode",
        jaxrl_kernels.paged_decode_attention(
            q[:, 0], pages_k, pages_v, lengths, table, interpret=interpret
        ),
        paged_decode_attention_reference(q[:, 0], pages_k, pages_v, lengths, table),
    )
    return failures


def _prefill(args, on_gpu, dtype, interpret):
    import jax

    from jaxrl_kernels.flash_attention import flash_attention_reference

    rows = []
    ts = (64, 128) if args.smoke else PREFILL_T
    hq, hkv, d = (8, 2, 64) if args.smoke else (HQ, HKV, D)
    for T in ts:
        B = max(1, args.prefill_tokens // T)
        ks = jax.random.split(jax.random.key(T), 3)
        q = jax.random.normal(ks[0], (B, T, hq, d), dtype)
        k = jax.random.normal(ks[1], (B, T, hkv, d), dtype)
        v = jax.random.normal(ks[2], (B, T, hkv, d), dtype)
        flops = 2 * B * hq * T * T * d  # causal: half of 4 * B * Hq * T^2 * D
        impls = {
            "pallas": jax.jit(
                lambda q, k, v: jaxrl_kernels.flash_attention(q, k, v, interpret=interpret)
            )
        }
        if not args.skip_xla:
            impls["xla"] = jax.jit(lambda q, k, v: flash_attention_reference(q, k, v))
        if on_gpu:
            impls["cudnn"] = jax.jit(
                lambda q, k, v: jax.nn.dot_product_attention(
                    q, k, v, is_causal=True, implementation="cudnn"
                )
            )
        row = {"T": T, "B": B}
        for name, fn in impls.items():
            try:
                row[name] = flops / _time_per_call(fn, q, k, v, iters=args.iters) / 1e12
                if args.backward:
                    fwd_bwd = jax.jit(lambda q, k, v, fn=fn: jax.vjp(fn, q, k, v)[1](q))
                    t = _time_per_call(fwd_bwd, q, k, v, iters=args.iters)
                    row[f"{name}_fwdbwd"] = 3.5 * flops / t / 1e12
            except Exception as e:  # noqa: BLE001 - report a missing peer, keep the others
                print(f"  prefill T={T} {name}: unavailable ({type(e).__name__}: {e})"[:300])
        if "cudnn" in row:
            row["pallas/cudnn"] = row["pallas"] / row["cudnn"]
        if "cudnn_fwdbwd" in row and "pallas_fwdbwd" in row:
            row["fwdbwd pallas/cudnn"] = row["pallas_fwdbwd"] / row["cudnn_fwdbwd"]
        rows.append(row)
        print(
            "  prefill "
            + "  ".join(
                f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
            )
        )
    return rows


def _decode(args, dtype, interpret, copy_gbps):
    import jax
    import jax.numpy as jnp

    from jaxrl_kernels.decode_attention import decode_attention_reference

    rows = []
    batches, contexts = ((4,), (128,)) if args.smoke else (DECODE_BATCH, DECODE_CONTEXT)
    hq, hkv, d = (8, 2, 64) if args.smoke else (HQ, HKV, D)
    page_size = 16 if args.smoke else 64
    for B in batches:
        for L in contexts:
            ks = jax.random.split(jax.random.key(B * L), 3)
            q = jax.random.normal(ks[0], (B, hq, d), dtype)
            k = jax.random.normal(ks[1], (B, L, hkv, d), dtype)
            v = jax.random.normal(ks[2], (B, L, hkv, d), dtype)
            lengths = jnp.full((B,), L, jnp.int32)
            P = L // page_size
            k_pages = k.reshape(B * P, page_size, hkv, d)
            v_pages = v.reshape(B * P, page_size, hkv, d)
            table = jnp.arange(B * P, dtype=jnp.int32).reshape(B, P)
            kv_bytes = 2 * B * L * hkv * d * jnp.dtype(dtype).itemsize
            row = {"B": B, "L": L}
            impls = {
                "pallas": (
                    jax.jit(
                        lambda q, k, v, n: jaxrl_kernels.decode_attention(
                            q, k, v, n, interpret=interpret
                        )
                    ),
                    (q, k, v, lengths),
                ),
                "paged": (
                    jax.jit(
                        lambda q, k, v, n, t: jaxrl_kernels.paged_decode_attention(
                            q, k, v, n, t, interpret=interpret
                        )
                    ),
                    (q, k_pages, v_pages, lengths, table),
                ),
            }
            if not args.skip_xla:
                impls["xla"] = (jax.jit(decode_attention_reference), (q, k, v, lengths))
            for name, (fn, fargs) in impls.items():
                row[f"{name}_GBps"] = kv_bytes / _time_per_call(fn, *fargs, iters=args.iters) / 1e9
            if copy_gbps:
                row["pallas/copy"] = row["pallas_GBps"] / copy_gbps
            rows.append(row)
            print(
                "  decode "
                + "  ".join(
                    f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items()
                )
            )
    return rows


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import jax

    if jax.default_backend() == "cpu" and not args.smoke:
        print(
            "bench.py kernels needs a GPU or TPU (Pallas kernels only interpret on CPU, so "
            "timings would mean nothing). Run it on an accelerator, or pass --smoke for a tiny "
            "interpreted end-to-end run.",
            file=sys.stderr,
        )
        return 2
    result = run(args, argv)
    if result is None:
        return 1
    if args.json:
        with open(args.json, "w") as f:
            json.dump(result, f, indent=1)
    return 0


def run(args, argv: list[str]) -> dict | None:
    """Correctness, then the prefill and decode figures (`args` from `_parse`); prints the text
    report as it goes. None (after a message on stderr) when a kernel disagrees with its
    reference."""
    import jax
    import jax.numpy as jnp

    platform = jax.default_backend()
    on_gpu = platform in ("gpu", "cuda", "rocm")
    interpret = platform == "cpu"
    dtype = jnp.float32 if interpret else jnp.bfloat16
    if args.smoke:
        args.iters, args.prefill_tokens = min(args.iters, 2), min(args.prefill_tokens, 128)
    device = jax.devices()[0].device_kind
    print(f"device: {device} ({platform}), jax {jax.__version__}, dtype {jnp.dtype(dtype).name}")
    failures = _check_correctness(interpret, dtype)
    if failures:
        print(f"correctness FAILED: {failures}; no timings", file=sys.stderr)
        return None
    copy_gbps = None if interpret else _copy_bandwidth(args.iters)
    if copy_gbps:
        print(f"  measured copy bandwidth: {copy_gbps:.0f} GB/s")
    result = {
        "device": device,
        "jax": jax.__version__,
        "command": "python launch/bench.py kernels " + " ".join(argv),
        "copy_GBps": copy_gbps,
        "prefill": _prefill(args, on_gpu, dtype, interpret),
        "decode": _decode(args, dtype, interpret, copy_gbps),
    }
    if on_gpu:
        worst = min(r.get("pallas/cudnn", 0.0) for r in result["prefill"])
        print(f"target prefill >= 0.70 of cuDNN: worst {worst:.2f}")
    if copy_gbps:
        worst = min(r["pallas/copy"] for r in result["decode"])
        print(f"target decode >= 0.70 of copy bandwidth: worst {worst:.2f}")
    return result


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
