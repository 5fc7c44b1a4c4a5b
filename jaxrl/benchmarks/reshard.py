"""`python launch/bench.py reshard`: trainer-mesh -> generator-mesh weight sync, GB/s.

The parameters of a model (default: the ~40M Qwen2-shaped model of `bench.py train`) are created
sharded on a trainer mesh and moved onto the generator mesh's shardings, built from a disjoint
set of devices, by `jaxrl.controller.weight_sync.WeightSync` (what `launch/run.py` does every
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
    return p


def main(argv: list[str]) -> int:
    args = _parser().parse_args(argv)
    if "XLA_FLAGS" not in os.environ:
        os.environ["XLA_FLAGS"] = f"--xla_force_host_platform_device_count={args.devices}"
    import jax
    import numpy as np
    from flax import nnx

    from jaxrl.config import MeshConfig
    from jaxrl.controller.weight_sync import WeightSync
    from jaxrl.models.model import abstract_model, create_model
    from jaxrl.sharding import make_meshes, pure_state_shardings

    if args.model == "bench":
        from jaxrl.benchmarks.train import bench_model_config

        model_cfg = bench_model_config(argparse.Namespace(seq=512, dtype="float32"))
    else:
        from jaxrl.presets import tiny_model_config

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
    print(json.dumps(out))
    return 0
