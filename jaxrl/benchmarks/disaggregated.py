"""Prefill/decode disaggregation against one colocated generator mesh, on the same devices.

    python launch/bench.py disaggregated [--devices 4 --prefill-devices 2 --tp 1 ...]

The colocated side is a `JaxEngine` on all `--devices` (dp x tp); the disaggregated side a
`DisaggregatedEngine` whose first `--prefill-devices` of them prefill and the rest decode. Both
serve the same greedy requests (`--requests` prompts of `--prompt` tokens, exactly `--new` new
tokens each) through a `Scheduler`, in interleaved rounds (alternating which goes first) after a
warm-up round that compiles. Reports end-to-end tokens/s of each (median over rounds), the
per-request KV transfer time (mean over the timed rounds) and bytes, and whether the greedy
tokens agree. On
a CPU, `--devices` simulated devices are made by XLA (set before JAX starts) and share the host's
cores: the figures show overheads, not a speed-up.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import numpy as np

from jaxrl.config import ModelConfig


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench.py disaggregated", description=__doc__.split("\n")[0])
    p.add_argument("--devices", type=int, default=4, help="generator devices (both sides)")
    p.add_argument("--prefill-devices", type=int, default=2, help="of them, the prefill group")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of every mesh")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--intermediate", type=int, default=768)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--heads", type=int, default=4)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--vocab", type=int, default=1024)
    p.add_argument("--requests", type=int, default=16)
    p.add_argument("--num-slots", type=int, default=16)
    p.add_argument("--prompt", type=int, default=64)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--chunk-steps", type=int, default=16)
    p.add_argument("--rounds", type=int, default=3, help="timed rounds per side")
    args = p.parse_args(argv)
    for name in ("devices", "tp", "hidden", "intermediate", "layers", "heads", "kv_heads",
                 "vocab", "requests", "num_slots", "prompt", "new", "chunk_steps", "rounds"):
        if getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.devices % args.tp:
        p.error(f"--devices={args.devices} is not a multiple of --tp={args.tp}")
    valid = list(range(args.tp, args.devices, args.tp))
    if args.prefill_devices not in valid:
        p.error(f"--prefill-devices={args.prefill_devices} does not split {args.devices} devices "
                f"with tp={args.tp}; valid: {valid or 'none (raise --devices)'}")
    return args


def _round(engine, prompts, sampling):
    from jaxrl.generate import Scheduler

    sched = Scheduler(engine)
    for prompt in prompts:
        sched.submit(prompt, sampling)
    start = time.perf_counter()
    done = sorted(sched.run(), key=lambda c: c.request_id)
    wall = time.perf_counter() - start
    return [c.tokens for c in done], sum(len(c.tokens) for c in done) / wall


def main(argv=None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    flags = os.environ.get("XLA_FLAGS", "")
    if "xla_force_host_platform_device_count" not in flags:
        os.environ["XLA_FLAGS"] = f"{flags} --xla_force_host_platform_device_count={args.devices}"
    import jax

    from jaxrl.generate import JaxEngine, SamplingParams
    from jaxrl.generate.disaggregated import DisaggregatedEngine, split_generator_mesh
    from jaxrl.models import create_model
    from jaxrl.sharding import make_mesh

    if len(jax.devices()) < args.devices:
        print(f"bench.py disaggregated: --devices={args.devices} but {len(jax.devices())} "
              f"{jax.devices()[0].platform} device(s) exist", file=sys.stderr)
        return 2
    cfg = ModelConfig(architecture="qwen2", vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_layers=args.layers,
                      num_heads=args.heads, num_kv_heads=args.kv_heads,
                      max_position_embeddings=max(512, args.prompt + args.new))
    model = create_model(cfg, seed=0)
    mesh = make_mesh((args.devices // args.tp, args.tp), "generator",
                     jax.devices()[: args.devices])
    prefill_mesh, decode_mesh = split_generator_mesh(mesh, args.prefill_devices)
    kw = dict(num_slots=args.num_slots, max_len=args.prompt + args.new,
              chunk_steps=args.chunk_steps)
    engines = {"colocated": JaxEngine(model, mesh=mesh, **kw),
               "disaggregated": DisaggregatedEngine(model, prefill_mesh=prefill_mesh,
                                                    mesh=decode_mesh, **kw)}
    rng = np.random.default_rng(0)
    prompts = [rng.integers(0, args.vocab, args.prompt).tolist() for _ in range(args.requests)]
    sampling = SamplingParams(max_tokens=args.new, temperature=0.0, ignore_eos=True)
    tokens = {name: _round(e, prompts, sampling)[0] for name, e in engines.items()}  # compile
    disagg = engines["disaggregated"]
    first, first_s = disagg.kv_transfers, disagg.kv_transfer_s  # the warm-up's excluded
    rates = {name: [] for name in engines}
    for r in range(args.rounds):
        for name in (list(engines) if r % 2 == 0 else list(engines)[::-1]):
            rates[name].append(_round(engines[name], prompts, sampling)[1])
    moves = disagg.kv_transfers - first
    row = {
        "devices": args.devices, "prefill_devices": args.prefill_devices, "tp": args.tp,
        "platform": jax.devices()[0].platform, "requests": args.requests,
        "prompt": args.prompt, "new": args.new,
        "colocated_tokens_per_s": statistics.median(rates["colocated"]),
        "disaggregated_tokens_per_s": statistics.median(rates["disaggregated"]),
        "kv_transfer_s_mean": (disagg.kv_transfer_s - first_s) / moves,
        "kv_transfer_bytes": disagg.last_kv_transfer[1],
        "kv_transfers_timed": moves,
        "greedy_tokens_equal": tokens["colocated"] == tokens["disaggregated"],
        "load_avg_1m": os.getloadavg()[0],
    }
    print(json.dumps(row))
    print(f"colocated {row['colocated_tokens_per_s']:.1f} tok/s, disaggregated "
          f"{row['disaggregated_tokens_per_s']:.1f} tok/s (medians of {args.rounds}); KV "
          f"transfer {row['kv_transfer_s_mean'] * 1e3:.2f} ms per request (mean of "
          f"{moves}), {row['kv_transfer_bytes']} bytes; greedy tokens equal: "
          f"{row['greedy_tokens_equal']}")
    return 0
