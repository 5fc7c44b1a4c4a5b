"""Serve a jaxrl policy with JetStream's gRPC server.

    pip install 'jaxrl[jetstream]'     # google-jetstream 0.2.2 (+ TensorFlow through seqio)
    python -m jaxrl.serving.jetstream --model /path/to/hf_checkpoint --port 9000
    python -m jaxrl.serving.jetstream --model tiny --tokenizer char   # random tiny model (smoke)

Clients speak JetStream's `Orchestrator.Decode` (jetstream/core/proto/jetstream.proto): text or
token ids plus `max_tokens`; sampling is set here for the whole server (`--temperature`,
`--top-k`, `--top-p`, `--seed`; greedy by default). With `--prefill-devices N` prefill runs on
the first N devices and generation on the next `--generate-devices` (disaggregated, separate
meshes); otherwise one engine on all devices does both (JetStream's interleaved mode).
"""

from __future__ import annotations

import argparse
import logging
import sys

import jax

from jaxrl.generate.sampling import SamplingParams
from jaxrl.models import create_model
from jaxrl.presets import tiny_model_config
from jaxrl.sharding import make_mesh
from jaxrl.tokenizers import load_tokenizer


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m jaxrl.serving.jetstream", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True,
                   help="local Hugging Face checkpoint directory, or 'tiny' (random tiny model)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or 'char' (default: the model directory; 'char' "
                        "for --model tiny); 'none' serves token-id requests only")
    p.add_argument("--dtype", default=None, help="parameter/compute dtype (default float32)")
    p.add_argument("--port", type=int, default=9000)
    p.add_argument("--threads", type=int, default=None, help="gRPC worker threads")
    p.add_argument("--num-slots", type=int, default=8, help="concurrent decodes")
    p.add_argument("--max-len", type=int, default=1024, help="KV-cache length per slot")
    p.add_argument("--max-prefill-length", type=int, default=None,
                   help="longest prompt (a JetStream bucket: 16, 32, ... ; default max_len/2)")
    p.add_argument("--tp", type=int, default=1, help="tensor-parallel size of each mesh")
    p.add_argument("--prefill-devices", type=int, default=0,
                   help="devices for a separate prefill mesh (0: one interleaved engine)")
    p.add_argument("--generate-devices", type=int, default=0,
                   help="devices for the generate mesh (default: all, or all after prefill)")
    p.add_argument("--temperature", type=float, default=0.0)
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def _mesh(devices, tp: int, what: str):
    if len(devices) % tp:
        raise SystemExit(f"{what}: {len(devices)} devices do not split into tp={tp}")
    return make_mesh((len(devices) // tp, tp), "generator", devices)


def build(args: argparse.Namespace):
    """(prefill engine, generate engine) for the parsed arguments."""
    from jaxrl.serving.jetstream_adapter import make_jetstream_engines

    devices = jax.devices()
    np_, ng = args.prefill_devices, args.generate_devices
    if np_:
        ng = ng or len(devices) - np_
        if np_ + ng > len(devices) or ng < 1:
            raise SystemExit(f"{np_} prefill + {ng} generate devices; {len(devices)} exist")
        prefill_mesh = _mesh(devices[:np_], args.tp, "prefill mesh")
        generate_mesh = _mesh(devices[np_:np_ + ng], args.tp, "generate mesh")
    else:
        generate_mesh = _mesh(devices[:ng or len(devices)], args.tp, "generate mesh")
        prefill_mesh = generate_mesh
    if args.model == "tiny":
        model = create_model(tiny_model_config(), mesh=generate_mesh, role="generator")
        tok_path = args.tokenizer or "char"
    else:
        model = args.model
        tok_path = args.tokenizer or args.model
    tokenizer = None if tok_path == "none" else load_tokenizer(tok_path)
    sampling = SamplingParams(temperature=args.temperature, top_k=args.top_k, top_p=args.top_p,
                              seed=args.seed)
    return make_jetstream_engines(
        model, num_slots=args.num_slots, max_len=args.max_len, tokenizer=tokenizer,
        prefill_mesh=prefill_mesh, generate_mesh=generate_mesh, sampling=sampling,
        max_prefill_length=args.max_prefill_length, dtype=args.dtype,
        tokenizer_path=str(tok_path))


def main(argv=None) -> int:
    args = parse_args(argv)
    try:
        import grpc
        from jetstream.core import server_lib
    except ImportError as e:
        print(f"JetStream is not installed ({e}); pip install 'jaxrl[jetstream]'", file=sys.stderr)
        return 2
    from jaxrl.serving.jetstream_adapter import make_driver

    prefill, generate = build(args)
    driver = make_driver(prefill, generate)
    threads = args.threads or max(driver.get_total_concurrent_requests(), 64)
    server = server_lib.JetStreamServer(driver, threads, args.port,
                                        grpc.insecure_server_credentials())
    server.start()
    logging.getLogger(__name__).warning("JetStream serving %s on port %d (%d slots)",
                                        args.model, args.port, args.num_slots)
    server.wait_for_termination()  # stops the driver on exit
    return 0


if __name__ == "__main__":
    sys.exit(main())
