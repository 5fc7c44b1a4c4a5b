"""Decode throughput of jaxrl's generator, optionally against `transformers.generate`.

    python launch/bench.py generate [--vs hf] [--quantize int8] [--fuse] [--batch 32 ...]

Both sides use the same weights (saved by jaxrl, loaded by `transformers`), the same prompts, the
same sampling settings and exactly `--new` new tokens per sample (no EOS). Reports end-to-end
tokens/s (prefill included), decode-only tokens/s, and the fraction of the machine's roofline that
the decode steps reach: bytes (weights + valid KV) per step against a measured memory bandwidth,
and FLOPs per step against a measured f32 matmul peak. `--quantize int8` also times the weight-only
int8 generator (`generate.quantize`; likewise `w8a8` and `fp8`), interleaved with the unquantized
one in the same process (alternating which goes first), and reports the median of the paired
tokens/s ratios. `--fuse` does the same for fused q/k/v and gate/up projections against the
unfused generator (both int8 with `--quantize int8`).

`--vs hf` alone runs `transformers` in this process after jaxrl, not interleaved (load hits the
two sides differently); `--vs hf,ct2,vllm` (or `--isolated`) runs each engine -- jaxrl,
`transformers.generate`, CTranslate2 f32 and int8, vLLM's CPU backend -- in its own process,
rounds interleaved, peers in pinned virtual environments (`jaxrl/benchmarks/generate_peers.py`).
"""

from __future__ import annotations

import argparse
import functools
import json
import tempfile
import time
from pathlib import Path

import numpy as np

from jaxrl.benchmarks import generate_peers, missing_packages
from jaxrl.benchmarks.generate_peers import parse_vs
from jaxrl.config import ModelConfig

print = functools.partial(print, flush=True)  # progress shows while the peer runs


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench.py generate", description=__doc__.split("\n")[0])
    p.add_argument("--vs", default="none", type=_vs,
                   help="peers, comma-separated: hf, ct2 (= ct2-f32,ct2-int8), ct2-f32, "
                        "ct2-int8, vllm, or none. `hf` alone: in this process after jaxrl (not "
                        "interleaved); anything with ct2 or vllm, or --isolated: each engine in "
                        "its own process, rounds interleaved (jaxrl/benchmarks/generate_peers.py)")
    p.add_argument("--hidden", type=int, default=512)
    p.add_argument("--intermediate", type=int, default=1536)
    p.add_argument("--layers", type=int, default=8)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32000)
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=128)
    p.add_argument("--chunk-steps", type=int, default=32)
    p.add_argument("--max-len", type=int, default=0,
                   help="jaxrl's KV-cache length per slot (0: --prompt + --new); decode attention "
                        "reads the whole cache row, so this sets its cost")
    p.add_argument("--temperature", type=float, default=1.0)
    p.add_argument("--top-k", type=int, default=50, help="50 = transformers' default")
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32",
                   help="precision of jaxrl and of the transformers and vLLM peers (CTranslate2 "
                        "rows keep their named compute types)")
    p.add_argument("--attention-impl", choices=["xla", "pallas", "cudnn", "auto"], default="xla",
                   help="the model's attention_impl (cudnn needs an NVIDIA GPU)")
    p.add_argument("--hf-device", default="cpu",
                   help="torch device of the transformers peer, e.g. cuda (then timed with "
                        "torch.cuda.synchronize)")
    p.add_argument("--quantize", choices=["none", "int8", "w8a8", "fp8"], default="none",
                   help="int8 (weight-only), w8a8 (int8 weights and per-token activations) or "
                        "fp8 (the same in float8 e4m3): also time that generator, interleaved "
                        "with the plain one")
    p.add_argument("--fuse", action="store_true",
                   help="also time the generator with fused q/k/v and gate/up projections "
                        "(generate.fuse_projections), interleaved with the unfused one; with "
                        "--quantize int8, both sides int8")
    p.add_argument("--threads", type=int, default=2,
                   help="torch threads (and CTranslate2 intra_threads) of the peers")
    p.add_argument("--repeats", type=int, default=2,
                   help="timed runs per side (in process: best kept; isolated: median)")
    p.add_argument("--isolated", action="store_true",
                   help="each engine in its own process, interleaved (implied by ct2 peers)")
    p.add_argument("--rounds", type=int, default=3, help="isolated: interleaved rounds")
    p.add_argument("--greedy-prompts", type=int, default=4,
                   help="isolated: prompts decoded greedily in round 0, compared with hf's")
    p.add_argument("--greedy-new", type=int, default=32, help="isolated: greedy new tokens")
    p.add_argument("--timeout", type=float, default=1800.0, help="isolated: seconds per run")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "jaxrl" / "bench-venvs"),
                   help="isolated: peer virtual environments and the saved model")
    p.add_argument("--json", action="store_true", help="print one JSON line of results")
    args = p.parse_args(argv)
    for name in ("rounds", "repeats", "batch", "new", "greedy_prompts", "greedy_new"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.max_len and args.max_len < args.prompt + args.new:
        p.error(f"--max-len must be 0 or >= --prompt + --new = {args.prompt + args.new}, "
                f"got {args.max_len}")
    if args.max_len and isolated(args):
        p.error("--max-len applies to the in-process benchmark (--vs none or hf); the isolated "
                "workers size the cache to --prompt + --new")
    if isolated(args) and args.vocab < 259:  # the saved byte tokenizer's 259 ids
        p.error(f"--vs {args.vs} saves a 259-id byte tokenizer: --vocab must be >= 259, "
                f"got {args.vocab}")
    if (args.vs != "none" or args.isolated) and (
            why := missing_packages(f"--vs {args.vs}" if args.vs != "none" else "--isolated")):
        p.error(why)
    return args


def _vs(value: str) -> str:
    try:
        parse_vs(value)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return value.strip()


def isolated(args) -> bool:
    """Whether `args` asks for the process-per-engine comparison rather than the in-process one."""
    return args.isolated or args.vs not in ("none", "hf")


def measure_machine() -> dict[str, float]:
    """Memory bandwidth (GB/s, jitted reduction over 256 MiB) and f32 matmul peak (GFLOP/s)."""
    import jax
    import jax.numpy as jnp

    x = jnp.ones((64 * 1024 * 1024,), jnp.float32)
    total = jax.jit(jnp.sum)
    total(x).block_until_ready()
    best = min(_timed(lambda: total(x).block_until_ready()) for _ in range(5))
    bandwidth = x.nbytes / best / 1e9
    n = 2048
    a = jnp.ones((n, n), jnp.float32)
    mm = jax.jit(lambda a: a @ a)
    mm(a).block_until_ready()
    best = min(_timed(lambda: mm(a).block_until_ready()) for _ in range(5))
    return {"mem_gbps": bandwidth, "matmul_gflops": 2 * n**3 / best / 1e9}


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def _step_cost(cfg, batch: int, avg_len: float, bytes_per: int) -> tuple[float, float]:
    """(bytes, FLOPs) of one decode step: weights + valid KV entries; matmuls + attention."""
    weights = cfg.num_params() * bytes_per
    kv_per_token = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_size * bytes_per
    matmul_params = cfg.num_params(include_embeddings=False) + cfg.vocab_size * cfg.hidden_size
    flops = 2 * matmul_params * batch
    flops += 4 * batch * cfg.num_layers * cfg.num_heads * cfg.head_size * avg_len
    return weights + batch * avg_len * kv_per_token, flops


def _engine(model, args):
    from jaxrl.generate import JaxEngine

    return JaxEngine(model, num_slots=args.batch, max_len=args.max_len or args.prompt + args.new,
                     chunk_steps=args.chunk_steps, prefill_buckets=[args.prompt])


def _one_run(engine, prompts, args) -> dict[str, float]:
    import jax

    from jaxrl.generate import SamplingParams, Scheduler

    sp = SamplingParams(max_tokens=args.new, temperature=args.temperature, top_k=args.top_k,
                        top_p=args.top_p, seed=0)
    sched = Scheduler(engine)
    for p in prompts:
        sched.submit(p, sp)
    start = time.perf_counter()
    sched.refill()
    jax.block_until_ready(sched.state)
    prefilled = time.perf_counter()
    done = sched.run()
    end = time.perf_counter()
    assert all(len(c.tokens) == args.new for c in done), "a sample stopped early"
    return {"total_s": end - start, "decode_s": end - prefilled,
            "decode_steps": sched.stats.decode_steps,
            "slot_utilisation": sched.stats.slot_utilisation}


def run_jax(model, prompts, args) -> dict[str, float]:
    engine = _engine(model, args)
    _one_run(engine, prompts, args)  # compiles
    runs = [_one_run(engine, prompts, args) for _ in range(args.repeats)]
    return min(runs, key=lambda r: r["total_s"])


def _variant(model, args):
    """The generator copy under test: fused projections (`--fuse`), then int8 or w8a8
    (`--quantize`)."""
    from flax import nnx

    from jaxrl.models.quant import quantized_copy

    copy = nnx.merge(*nnx.split(model))
    if args.fuse:
        copy.fuse_projections()
    if args.quantize == "none":
        return copy
    return quantized_copy(copy, args.quantize)


def run_jax_vs(model, prompts, args, baseline=None) -> tuple[dict, dict, float]:
    """(baseline best, variant best, median of the paired variant/baseline tokens/s ratios and
    of the decode-only ones): `baseline` (default `model`) against `_variant(model)`, both
    engines compiled first, then `repeats` rounds, each timing both, the order alternating."""
    variant = _variant(model, args)
    engines = {"plain": _engine(model if baseline is None else baseline, args),
               "variant": _engine(variant, args)}
    for engine in engines.values():
        _one_run(engine, prompts, args)  # compiles
    runs: dict[str, list] = {"plain": [], "variant": []}
    for r in range(args.repeats):
        for side in ("plain", "variant") if r % 2 == 0 else ("variant", "plain"):
            runs[side].append(_one_run(engines[side], prompts, args))
    pairs = list(zip(runs["plain"], runs["variant"], strict=True))
    ratios = {key: float(np.median([p[key] / q[key] for p, q in pairs]))
              for key in ("total_s", "decode_s")}
    ratios["pairs"] = [round(p["total_s"] / q["total_s"], 3) for p, q in pairs]
    best = {k: min(v, key=lambda r: r["total_s"]) for k, v in runs.items()}
    return best["plain"], best["variant"], ratios


def run_hf(path, prompts, args) -> dict[str, float]:
    import torch
    import transformers

    torch.set_num_threads(args.threads)
    dtype = torch.float32 if args.dtype == "float32" else torch.bfloat16
    device = torch.device(args.hf_device)
    hf = transformers.AutoModelForCausalLM.from_pretrained(path, dtype=dtype).eval().to(device)
    ids = torch.tensor(prompts, device=device)
    sync = torch.cuda.synchronize if device.type == "cuda" else lambda: None
    kw = dict(attention_mask=torch.ones_like(ids), do_sample=True, temperature=args.temperature,
              top_k=args.top_k, top_p=args.top_p, eos_token_id=None, pad_token_id=0)
    best = None
    with torch.no_grad():
        hf.generate(ids, max_new_tokens=2, min_new_tokens=2, **kw)  # warm up
        for _ in range(args.repeats):
            torch.manual_seed(0)
            start = time.perf_counter()
            out = hf.generate(ids, max_new_tokens=args.new, min_new_tokens=args.new, **kw)
            sync()
            total = time.perf_counter() - start
            assert out.shape[1] == args.prompt + args.new
            # Prefill alone (one forward over the prompts), to split off decode time.
            start = time.perf_counter()
            hf(ids, attention_mask=torch.ones_like(ids))
            sync()
            prefill = time.perf_counter() - start
            res = {"total_s": total, "decode_s": max(total - prefill, 1e-9)}
            if best is None or total < best["total_s"]:
                best = res
    return best


def main(argv: list[str]) -> int:
    args = _parse(argv)
    if isolated(args):
        return generate_peers.main(args)
    results = run(args)
    if args.json:
        print(json.dumps(results))
    return 0


def run(args) -> dict[str, float]:
    """The figures of one run (`args` from `_parse`); prints the text report as it goes."""
    import jax

    from jaxrl.models import create_model, param_count

    cfg = ModelConfig(
        architecture="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
        intermediate_size=args.intermediate, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, qkv_bias=True, tie_embeddings=True,
        max_position_embeddings=max(2048, args.prompt + args.new), dtype=args.dtype,
        param_dtype=args.dtype, attention_impl=args.attention_impl,
    )
    model = create_model(cfg, seed=0)
    rng = np.random.default_rng(0)
    prompts = rng.integers(0, args.vocab, (args.batch, args.prompt)).tolist()
    tokens = args.batch * args.new
    print(f"generate: qwen2-shaped {param_count(model) / 1e6:.1f}M params, batch {args.batch}, "
          f"prompt {args.prompt}, new {args.new}, {args.dtype}, attention {args.attention_impl}, "
          f"backend {jax.default_backend()} ({jax.device_count()} device(s)), sampling "
          f"T={args.temperature} top_k={args.top_k} top_p={args.top_p}")
    machine = measure_machine()
    print(f"machine: memory bandwidth {machine['mem_gbps']:.1f} GB/s, "
          f"f32 matmul peak {machine['matmul_gflops']:.1f} GFLOP/s")
    if args.fuse:  # the baseline: unfused, and int8 when the fused side is
        baseline = model
        if args.quantize != "none":
            from jaxrl.models.quant import quantized_copy

            baseline = quantized_copy(model, args.quantize)
        ours, other, ratios = run_jax_vs(model, prompts, args, baseline)
    elif args.quantize != "none":
        ours, other, ratios = run_jax_vs(model, prompts, args)
    else:
        ours = run_jax(model, prompts, args)
    step_s = ours["decode_s"] / ours["decode_steps"]
    bytes_per = 4 if args.dtype == "float32" else 2
    step_bytes, step_flops = _step_cost(cfg, args.batch, args.prompt + args.new / 2, bytes_per)
    results = {
        "jaxrl_tokens_per_s": tokens / ours["total_s"],
        "jaxrl_decode_tokens_per_s": tokens / ours["decode_s"],
        "jaxrl_step_ms": step_s * 1e3,
        "slot_utilisation": ours["slot_utilisation"],
        "bandwidth_frac": step_bytes / step_s / 1e9 / machine["mem_gbps"],
        "flops_frac": step_flops / step_s / 1e9 / machine["matmul_gflops"],
        **machine,
    }
    print(f"jaxrl: {results['jaxrl_tokens_per_s']:.0f} tok/s end to end, "
          f"{results['jaxrl_decode_tokens_per_s']:.0f} tok/s decode "
          f"({results['jaxrl_step_ms']:.1f} ms/step, slot utilisation "
          f"{ours['slot_utilisation']:.2f})")
    print(f"roofline per decode step: {step_bytes / 1e6:.0f} MB -> "
          f"{results['bandwidth_frac']:.0%} of memory bandwidth; {step_flops / 1e9:.2f} GFLOP -> "
          f"{results['flops_frac']:.0%} of matmul peak")
    if args.fuse or args.quantize != "none":
        name = "fused" if args.fuse else args.quantize
        base = f"unfused {args.dtype if args.quantize == 'none' else args.quantize}"
        results[f"{name}_tokens_per_s"] = tokens / other["total_s"]
        results[f"{name}_decode_tokens_per_s"] = tokens / other["decode_s"]
        results[f"{name}_ratio"] = ratios["total_s"]
        results[f"{name}_decode_ratio"] = ratios["decode_s"]
        results[f"{name}_paired_ratios"] = ratios["pairs"]
        label = "fused projections" if args.fuse else {
            "int8": "int8 (weight-only)", "w8a8": "w8a8 (int8 weights, int8 activations)",
            "fp8": "fp8 (e4m3 weights, e4m3 activations)"}[
            args.quantize]
        print(f"jaxrl {label}: {results[f'{name}_tokens_per_s']:.0f} tok/s end to end, "
              f"{results[f'{name}_decode_tokens_per_s']:.0f} tok/s decode; {name} / "
              f"{base if args.fuse else args.dtype} {ratios['total_s']:.3f}x end to end, "
              f"{ratios['decode_s']:.3f}x decode (medians of {args.repeats} interleaved pairs)")
    if args.vs == "hf":
        from jaxrl.models import save_pretrained

        with tempfile.TemporaryDirectory() as tmp:
            save_pretrained(model, cfg, tmp, dtype=args.dtype)
            peer = run_hf(tmp, prompts, args)
        results["hf_tokens_per_s"] = tokens / peer["total_s"]
        results["hf_decode_tokens_per_s"] = tokens / peer["decode_s"]
        results["ratio"] = results["jaxrl_tokens_per_s"] / results["hf_tokens_per_s"]
        results["decode_ratio"] = (results["jaxrl_decode_tokens_per_s"]
                                   / results["hf_decode_tokens_per_s"])
        print(f"transformers ({args.hf_device}, {args.threads} torch threads): "
              f"{results['hf_tokens_per_s']:.0f} tok/s end to end, "
              f"{results['hf_decode_tokens_per_s']:.0f} tok/s decode")
        print(f"ratio jaxrl / transformers: {results['ratio']:.2f}x end to end, "
              f"{results['decode_ratio']:.2f}x decode")
    return results
