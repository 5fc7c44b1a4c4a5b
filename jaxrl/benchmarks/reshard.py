"""`python launch/bench.py reshard`: trainer-mesh -> generator-mesh weight sync, GB/s.

The parameters of a model (default: the ~40M Qwen2-shaped model of `bench.py train`) are created
sharded on a trainer mesh and moved onto the generator mesh's shardings, built from a disjoint
set of devices, by `jaxrl.rl.sync.WeightSync` (what `launch/run.py` does every
step). The peer in the same run is the host round trip a framework without device-to-device
resharding falls back to: `jax.device_get` of every parameter, then `jax.device_put` onto the
same targets. Both move the same bytes (after the optional dtype cast); each repetition runs the
two back to back and the ratio is the median of the paired ratios.

On CPU the devices are simulated (`--devices`, default 8, split by the mesh shapes), so the
figures measure the resharding machinery and host memory bandwidth, not an interconnect.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time

import numpy as np

from jaxrl.benchmarks.train import bench_model_config
from jaxrl.config import LoraConfig, MeshConfig
from jaxrl.presets import tiny_model_config


def _shape(text: str) -> tuple[int, int]:
    try:
        a, b = (int(x) for x in text.lower().split("x"))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected AxB (e.g. 2x2), got {text!r}") from None
    return a, b


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py reshard", description=__doc__.splitlines()[0])
    p.add_argument("--devices", type=int, default=8, help="simulated CPU devices (CPU only)")
    p.add_argument("--trainer", type=_shape, default=(2, 2), help="trainer mesh fsdp x tp")
    p.add_argument("--generator", type=_shape, default=(1, 4), help="generator mesh dp x tp")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"],
                   help="generator parameter dtype (bfloat16: cast on the trainer side)")
    p.add_argument("--chunk-mb", type=int, default=256, help="WeightSync chunk size (MiB)")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2, help="untimed repetitions first")
    p.add_argument("--model", choices=["bench", "tiny"], default="bench")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also time a LoRA run's sync (adapters of this rank on every projection; "
                        "merged on the generator, and applied in the forward pass) against the "
                        "full sync, and the generator's decode step with each")
    p.add_argument("--decode-batch", type=int, default=32, help="decode rows (--lora-rank)")
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    print(json.dumps(run(args)))
    return 0


def run(args) -> dict:
    """The figures of one run (`args` from `_parser()`); prints the text report as it goes."""
    import jax
    from flax import nnx

    from jaxrl.models.model import abstract_model, create_model
    from jaxrl.rl.sync import WeightSync
    from jaxrl.sharding import make_meshes, pure_state_shardings

    if args.model == "bench":
        model_cfg = bench_model_config(argparse.Namespace(seq=512, dtype="float32"))
    else:
        model_cfg = tiny_model_config()
    # one client's devices: resharding between devices, not between CPU clients (jaxrl/cpu.py)
    meshes = make_meshes(MeshConfig(trainer=args.trainer, generator=args.generator,
                                    cpu_cores="shared"))
    params = nnx.split(create_model(model_cfg, mesh=meshes.trainer))[1].to_pure_dict()
    gen_cfg = dataclasses.replace(model_cfg, param_dtype=args.dtype, dtype=args.dtype)
    targets = pure_state_shardings(nnx.split(abstract_model(gen_cfg))[1], meshes.generator,
                                   "generator")
    sync = WeightSync(targets, dtype=args.dtype, chunk_bytes=args.chunk_mb << 20)
    out_dtype = np.dtype(jax.numpy.dtype(args.dtype))

    def host_round_trip():
        jax.block_until_ready(params)
        t0 = time.perf_counter()
        host = jax.device_get(params)
        host = jax.tree.map(lambda x: x.astype(out_dtype), host)
        moved = jax.block_until_ready(jax.device_put(host, targets))
        return moved, time.perf_counter() - t0

    moved, stats = sync(params)  # warm up: compiles the cast / copy, checks the result
    peer, _ = host_round_trip()
    same = jax.tree.map(lambda a, b: bool(np.array_equal(np.asarray(a), np.asarray(b))), moved,
                        peer)
    if not all(jax.tree.leaves(same)):
        raise SystemExit("WeightSync and the host round trip disagree on the moved parameters")
    placed = jax.tree.map(lambda x, s: x.sharding == s, moved, targets)
    if not all(jax.tree.leaves(placed)):
        raise SystemExit("WeightSync left a parameter off its target sharding")
    for _ in range(args.warmup):
        sync(params), host_round_trip()
    rows = []
    for i in range(args.repeats):
        _, s = sync(params)
        _, host_s = host_round_trip()
        rows.append((s.seconds, host_s))
        print(f"[{i}] weight_sync {s.seconds * 1e3:.1f} ms ({s.gbps:.2f} GB/s, {s.chunks} "
              f"chunks)  host round trip {host_s * 1e3:.1f} ms", flush=True)
    sync_s = statistics.median(r[0] for r in rows)
    host_s = statistics.median(r[1] for r in rows)
    out = {
        "model_params": model_cfg.num_params(),
        "bytes": stats.bytes,
        "dtype": args.dtype,
        "trainer_mesh": dict(meshes.trainer.shape),
        "generator_mesh": dict(meshes.generator.shape),
        "devices": f"{len(jax.devices())} {jax.devices()[0].platform}",
        "weight_sync_s": sync_s,
        "weight_sync_gbps": stats.bytes / sync_s / 1e9,
        "host_round_trip_s": host_s,
        "host_round_trip_gbps": stats.bytes / host_s / 1e9,
        "speedup_vs_host": statistics.median(h / s for s, h in rows),
    }
    print(f"weight sync: {stats.bytes / 1e6:.1f} MB {args.dtype}, trainer {out['trainer_mesh']} "
          f"-> generator {out['generator_mesh']}: {out['weight_sync_gbps']:.2f} GB/s vs host "
          f"round trip {out['host_round_trip_gbps']:.2f} GB/s: {out['speedup_vs_host']:.2f}x "
          "(median of paired ratios)")
    if args.lora_rank:
        out["lora"] = lora_rows(args, model_cfg, meshes, sync, params)
    return out


def lora_rows(args, model_cfg, meshes, full_sync, full_params) -> dict:
    """A LoRA run's publish (adapters moved, then merged or kept for the forward pass) against
    the full sync, interleaved; and one decode step of the generator's model in each mode."""
    import jax
    import jax.numpy as jnp
    from flax import nnx

    from jaxrl.models import lora
    from jaxrl.models.model import create_model
    from jaxrl.models.transformer import KVCache
    from jaxrl.rl.sync import lora_publisher

    r = args.lora_rank
    publishers, graphdefs, states = {}, {}, {}
    for mode in ("merge", "forward"):
        cfg = dataclasses.replace(model_cfg, param_dtype=args.dtype, dtype=args.dtype,
                                  lora=LoraConfig(rank=r, alpha=2.0 * r, generator=mode))
        params = nnx.split(create_model(dataclasses.replace(cfg, param_dtype="float32",
                                                            dtype="float32"),
                                        mesh=meshes.trainer))[1].to_pure_dict()
        base, adapters = lora.split(params)
        leaves, tree = jax.tree.flatten(adapters)
        keys = jax.random.split(jax.random.key(0), len(leaves))
        adapters = jax.tree.unflatten(tree, [x + 0.01 * jax.random.normal(k, x.shape)
                                             for x, k in zip(leaves, keys, strict=True)])
        publishers[mode], graphdefs[mode] = lora_publisher(cfg, meshes.generator, base, None)
        for _ in range(1 + args.warmup):
            states[mode], m = publishers[mode].publish(adapters, 0)
        publishers[mode] = (publishers[mode], adapters)
    rows = []
    for i in range(args.repeats):
        row = {"full_s": full_sync(full_params)[1].seconds}
        for mode, (pub, adapters) in publishers.items():
            t0 = time.perf_counter()
            _, m = pub.publish(adapters, i + 1)
            row[f"{mode}_s"] = time.perf_counter() - t0
            row[f"{mode}_bytes"] = m["pipeline/weight_sync_bytes"]
        rows.append(row)
        print(f"[{i}] full sync {row['full_s'] * 1e3:.1f} ms  lora publish: merge "
              f"{row['merge_s'] * 1e3:.1f} ms, forward {row['forward_s'] * 1e3:.1f} ms",
              flush=True)
    # decode: one token per row against a half-full cache, the generator's model in each mode
    b, max_len = args.decode_batch, 256
    decode_s = {}
    fns = {mode: jax.jit(lambda state, tok, cache, g=graphdefs[mode]:
                         nnx.merge(g, state).decode(tok, cache)[0])
           for mode in graphdefs}
    cache = KVCache.init(model_cfg, b, max_len, jnp.dtype(args.dtype))
    cache = dataclasses.replace(cache, lengths_B=jnp.full((b,), max_len // 2, jnp.int32))
    tok = jnp.zeros((b, 1), jnp.int32)
    for mode, fn in fns.items():
        jax.block_until_ready(fn(states[mode], tok, cache))
    times = {mode: [] for mode in fns}
    for _ in range(max(args.repeats, 5)):
        for mode, fn in fns.items():  # interleaved
            t0 = time.perf_counter()
            jax.block_until_ready(fn(states[mode], tok, cache))
            times[mode].append(time.perf_counter() - t0)
    decode_s = {mode: statistics.median(v) for mode, v in times.items()}
    med = lambda k: statistics.median(r[k] for r in rows)  # noqa: E731
    out = {"rank": r, "adapter_bytes": rows[0]["merge_bytes"],
           "full_sync_s": med("full_s"), "merge_publish_s": med("merge_s"),
           "forward_publish_s": med("forward_s"),
           "publish_speedup_merge": statistics.median(x["full_s"] / x["merge_s"] for x in rows),
           "publish_speedup_forward": statistics.median(x["full_s"] / x["forward_s"]
                                                        for x in rows),
           "decode_step_s": decode_s,
           "decode_forward_over_merge": statistics.median(
               f / m for f, m in zip(times["forward"], times["merge"], strict=True))}
    print(f"LoRA rank {r}: {out['adapter_bytes'] / 1e6:.2f} MB per sync; publish: merge "
          f"{out['merge_publish_s'] * 1e3:.1f} ms ({out['publish_speedup_merge']:.1f}x faster "
          f"than the full sync), forward {out['forward_publish_s'] * 1e3:.1f} ms "
          f"({out['publish_speedup_forward']:.1f}x); decode step ({b} rows): merge "
          f"{decode_s['merge'] * 1e3:.1f} ms, forward {decode_s['forward'] * 1e3:.1f} ms "
          f"({out['decode_forward_over_merge']:.2f}x, median of paired ratios)")
    return out
