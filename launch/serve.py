"""Serve a base model over the Tinker protocol: `python launch/serve.py --base-model DIR_OR_ID
[--host 127.0.0.1] [--port 8000] [--api-key tml-... | --api-keys FILE] [--full-params]
[--state-dir DIR] [--max-request-mb 32] [--max-num-samples 256] [--max-sample-tokens N]
[--max-lora-rank 128]`.

Scripts written against the `tinker` SDK then use `tinker.ServiceClient(base_url=URL,
api_key=KEY)`; see docs/service.md. Needs the `service` extra (`pip install 'jaxrl[service]'`).
Arguments are checked before JAX is imported; the URL is printed once requests are accepted.
"""

import argparse
import os
import sys

LOCAL = ("127.0.0.1", "localhost", "::1")


def parse(argv):
    p = argparse.ArgumentParser(prog="python launch/serve.py", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-model", required=True,
                   help="local Hugging Face directory, Hub id, or 'tiny' / 'tiny-task' (random)")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--api-key", default=None,
                   help="required on every request (X-API-Key); needed when --host is not local. "
                        "The SDK insists on a key starting with 'tml-'")
    p.add_argument("--api-keys", default=None, metavar="FILE",
                   help="per-client credentials: one key per line ('#' comments), each its own "
                        "owner; a key never sees another's models, weights, samplers or futures")
    p.add_argument("--full-params", action="store_true",
                   help="every training client trains all base parameters (the SDK's LoRA "
                        "request is taken as a request to train the model); one owner only")
    p.add_argument("--max-len", type=int, default=1024, help="longest sequence (tokens)")
    p.add_argument("--num-slots", type=int, default=8, help="concurrent samples per engine")
    p.add_argument("--max-batch-tokens", type=int, default=65536,
                   help="largest forward_backward request (tokens); larger ones are refused")
    limits = p.add_argument_group("limits", "checked when a request arrives, before any model "
                                  "work; a request over one is refused (HTTP 400) naming it")
    limits.add_argument("--max-request-mb", type=float, default=32,
                        help="largest request body (MiB); refused from its Content-Length, "
                             "before it is read (default 32)")
    limits.add_argument("--max-num-samples", type=int, default=256,
                        help="num_samples of one sample request (default 256)")
    limits.add_argument("--max-sample-tokens", type=int, default=None,
                        help="max_tokens of one sample (default: --max-len; prompt + max_tokens "
                             "must fit --max-len in any case)")
    limits.add_argument("--max-lora-rank", type=int, default=128,
                        help="LoRA rank of a training client (default 128)")
    p.add_argument("--state-dir", default=None,
                   help="where saved weights and sampling sessions are written, so they survive "
                        "a restart (default: $XDG_STATE_HOME/jaxrl/service or "
                        "~/.local/state/jaxrl/service)")
    args = p.parse_args(argv)
    if args.state_dir is None:
        base = os.environ.get("XDG_STATE_HOME") or os.path.expanduser("~/.local/state")
        args.state_dir = os.path.join(base, "jaxrl", "service")
    if not 0 <= args.port < 65536:
        p.error(f"--port must be in 0..65535, got {args.port}")
    if not args.max_request_mb > 0:
        p.error(f"--max-request-mb must be > 0, got {args.max_request_mb}")
    for name in ("max_len", "num_slots", "max_batch_tokens", "max_num_samples",
                 "max_sample_tokens", "max_lora_rank"):
        if getattr(args, name) is not None and getattr(args, name) < 1:
            p.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    args.keys = [args.api_key] if args.api_key else []
    if args.api_keys is not None:
        try:
            lines = open(args.api_keys).read().splitlines()
        except OSError as e:
            p.error(f"--api-keys {args.api_keys}: {e.strerror}")
        for n, line in enumerate(lines, 1):
            key = line.split("#", 1)[0].strip()
            if key and (not key.startswith("tml-") or " " in key):
                p.error(f"--api-keys {args.api_keys} line {n}: a key is one word starting with "
                        f"'tml-' (the SDK refuses others), got {key[:8]!r}...")
            if key:
                args.keys.append(key)
        if not args.keys:
            p.error(f"--api-keys {args.api_keys} holds no keys")
    if len(set(args.keys)) != len(args.keys):
        p.error("--api-key / --api-keys: the same key is given twice")
    if args.full_params and len(args.keys) > 1:
        p.error(f"--full-params serves a single owner; got {len(args.keys)} keys")
    if args.host not in LOCAL and not args.keys:
        p.error(f"--host {args.host} exposes the service beyond this machine: set --api-key or "
                "--api-keys")
    return args


def main(argv) -> int:
    args = parse(argv)
    try:
        import aiohttp  # noqa: F401
        import tinker  # noqa: F401
    except ImportError as e:
        print(f"error: {e.name} is missing: pip install 'jaxrl[service]'", file=sys.stderr)
        return 2
    from jaxrl.config import ConfigError
    from jaxrl.service.backend import Backend
    from jaxrl.service.limits import MB, Limits
    from jaxrl.service.running import serve
    from jaxrl.service.server import Service

    try:
        backend = Backend.load(args.base_model, max_len=args.max_len, num_slots=args.num_slots,
                               max_batch_tokens=args.max_batch_tokens, state_dir=args.state_dir)
    except (ConfigError, OSError, ValueError) as e:
        where = "" if args.base_model in str(e) else f"--base-model {args.base_model}: "
        print(f"error: {where}{e}", file=sys.stderr)
        return 2
    limits = Limits(max_body_bytes=int(args.max_request_mb * MB),
                    max_num_samples=args.max_num_samples,
                    max_sample_tokens=args.max_sample_tokens, max_lora_rank=args.max_lora_rank)
    serve(Service(backend, api_keys=args.keys, full_params=args.full_params, limits=limits),
          args.host, args.port)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
