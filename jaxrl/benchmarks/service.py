"""The Tinker-compatible service: `python launch/bench.py service [options]`.

Requests/s and tokens/s of `forward_backward` and `sample` three ways, in one process, rounds
interleaved (one warm-up round first, untimed):

    inproc      the backend methods the server's worker runs, called directly (no HTTP, no SDK):
                the peer, what the service costs on top of the compute; one adapter per step
    inproc-batch  the 4 adapters' requests batched as the worker runs them when they are queued:
                forward_backward in one step each (`Backend.forward_backward_many`), sample in
                one decode batch each (`Backend.sample_many`: a `MultiLoraEngine` run, every
                slot on its own adapter)
    http-seq    the official SDK over HTTP, 4 single-adapter runs one after another (each
                request waits for the one before)
    http-conc   the same 4 adapters' requests all in flight at once (the worker batches what is
                queued; the mean batch size is printed)

First the `--adapters` LoRA clients are created one after another, and the first's and second's
creation times printed (the second, of a layout met before, compiles nothing).

Each round, each of `--adapters` LoRA clients sends `--requests` `forward_backward` calls of
`--batch` sequences x `--seq` tokens (cross-entropy), then `--requests` `sample` calls of
`--samples` x `--max-tokens` tokens (EOS ignored) from its own saved weights. The server decodes
in `--slots` slots (default `--samples`: one request fills them; `--adapters` x `--samples` lets
a batch of every adapter's request run at once).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import numpy as np

print = functools.partial(print, flush=True)


def _parse(argv):
    p = argparse.ArgumentParser(prog="bench.py service", description=__doc__.split("\n")[0])
    p.add_argument("--base-model", default="tiny-task")
    p.add_argument("--adapters", type=int, default=4)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--requests", type=int, default=4, help="of each kind, per adapter and round")
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seq", type=int, default=64)
    p.add_argument("--samples", type=int, default=4)
    p.add_argument("--max-tokens", type=int, default=32)
    p.add_argument("--slots", type=int, default=0, help="decode slots (0: --samples)")
    p.add_argument("--repeats", type=int, default=3, help="timed rounds per way")
    p.add_argument("--json", action="store_true", help="print one JSON line of results")
    args = p.parse_args(argv)
    if args.slots < 0:
        p.error(f"--slots must be >= 0 (0: --samples), got {args.slots}")
    return args


def main(argv: list[str]) -> int:
    args = _parse(argv)
    import tinker
    from tinker import types

    from jaxrl.generate.sampling import SamplingParams
    from jaxrl.service.backend import Backend
    from jaxrl.service.server import Running, Service
    from jaxrl.service.wire import Datum, ForwardBackwardRequest

    backend = Backend.load(args.base_model, max_len=args.seq + args.max_tokens + 8,
                           num_slots=args.slots or args.samples)
    running = Running(Service(backend))
    rng = np.random.default_rng(0)
    seqs = rng.integers(3, 100, (args.batch, args.seq + 1))
    prompt = [int(t) for t in seqs[0, :8]]
    sdk_data = [types.Datum(model_input=types.ModelInput.from_ints(s[:-1].tolist()),
                            loss_fn_inputs={"target_tokens": s[1:]}) for s in seqs]
    sdk_params = types.SamplingParams(max_tokens=args.max_tokens, seed=0, stop=[])
    fb_tokens = args.adapters * args.requests * args.batch * args.seq
    sample_tokens = args.adapters * args.requests * args.samples * args.max_tokens
    print(f"service: {args.base_model} ({backend.cfg.num_params() / 1e6:.2f}M params), "
          f"{args.adapters} adapters rank {args.rank}, {args.requests} requests each: "
          f"forward_backward {args.batch}x{args.seq}, sample {args.samples}x{args.max_tokens} "
          f"on {backend.num_slots} slots; "
          f"load {os.getloadavg()[0]:.1f}")
    client = None
    try:
        client = tinker.ServiceClient(base_url=running.url, api_key="tml-local")
        tcs, create_s = [], []
        for i in range(args.adapters):  # the first compiles; the others must not (issue 48)
            t0 = time.perf_counter()
            tcs.append(client.create_lora_training_client(
                base_model=args.base_model, rank=args.rank, seed=i).result())
            create_s.append(time.perf_counter() - t0)
        print("create_lora_training_client: first " + f"{create_s[0]:.2f} s" + (
            f", second {create_s[1]:.2f} s" if len(create_s) > 1 else ""))
        paths = [tc.save_weights_for_sampler(f"bench-{i}").result().path
                 for i, tc in enumerate(tcs)]
        scs = [client.create_sampling_client(model_path=path).result() for path in paths]
        snaps = [backend.snapshot(path) for path in paths]
        reqs = [ForwardBackwardRequest(
            tc.model_id, 0, "cross_entropy", {}, False,
            [Datum(s[:-1].astype(np.int32), {"target_tokens": s[1:].astype(np.int32)})
             for s in seqs]) for tc in tcs]
        params = SamplingParams(max_tokens=args.max_tokens, seed=0, n=args.samples,
                                ignore_eos=True)

        def inproc_fb():
            for req in reqs:
                for _ in range(args.requests):
                    backend.forward_backward(req)

        def inproc_fb_batched():
            for _ in range(args.requests):
                backend.forward_backward_many(reqs)

        def inproc_sample():
            for snap in snaps:
                for _ in range(args.requests):
                    backend.sample(snap, prompt, params)

        def inproc_sample_batched():
            for _ in range(args.requests):
                for done in backend.sample_many([(snap, prompt, params) for snap in snaps]):
                    if isinstance(done, Exception):
                        raise done

        def http_fb(concurrent):
            futs = []
            for tc in tcs:
                for _ in range(args.requests):
                    futs.append(tc.forward_backward(sdk_data, "cross_entropy"))
                    if not concurrent:
                        futs.pop().result()
            [f.result() for f in futs]

        def http_sample(concurrent):
            futs = []
            for sc in scs:
                for _ in range(args.requests):
                    futs.append(sc.sample(types.ModelInput.from_ints(prompt), args.samples,
                                          sdk_params))
                    if not concurrent:
                        futs.pop().result()
            [f.result() for f in futs]

        ways = {"inproc": (inproc_fb, inproc_sample),
                "inproc-batch": (inproc_fb_batched, inproc_sample_batched),
                "http-seq": (lambda: http_fb(False), lambda: http_sample(False)),
                "http-conc": (lambda: http_fb(True), lambda: http_sample(True))}
        times = {(w, k): [] for w, fns in ways.items()
                 for k, fn in zip(("fb", "sample"), fns, strict=True) if fn is not None}
        worker = running.service.worker
        conc = {k: [0, 0] for k in ("fb", "sample")}  # http-conc: batched steps, their requests
        # compile every step size the worker can form (1, 2, 4, ..., max_batch adapters) before
        # timing: which sizes http-conc meets depends on arrival timing
        n = 1
        while n <= worker.max_batch:
            backend.forward_backward_many([reqs[i % len(reqs)] for i in range(n)])
            n *= 2
        for rnd in range(args.repeats + 1):
            for way, (fb, sample) in ways.items():
                for kind, fn in (("fb", fb), ("sample", sample)):
                    if fn is None:
                        continue
                    before = (worker.batched_steps, worker.batched_jobs)
                    t0 = time.perf_counter()
                    fn()
                    if rnd:
                        times[way, kind].append(time.perf_counter() - t0)
                        if way == "http-conc":
                            conc[kind][0] += worker.batched_steps - before[0]
                            conc[kind][1] += worker.batched_jobs - before[1]
        results = {"create_client_s": create_s}
        n_req = args.adapters * args.requests
        for (way, kind), ts in times.items():
            med = statistics.median(ts)
            tokens = fb_tokens if kind == "fb" else sample_tokens
            results[f"{way}/{kind}"] = {"req_s": n_req / med, "tok_s": tokens / med,
                                        "median_s": med}
        for kind in ("fb", "sample"):
            base = results[f"inproc/{kind}"]["median_s"]
            for way in ways:
                if f"{way}/{kind}" not in results:
                    continue
                r = results[f"{way}/{kind}"]
                print(f"{kind:6s} {way:9s} {r['req_s']:7.2f} req/s {r['tok_s']:9.0f} tok/s  "
                      f"x{base / r['median_s']:.2f} of inproc")
        for kind, name in (("fb", "forward_backward"), ("sample", "sample")):
            for a, b in (("inproc-batch", "inproc"), ("http-conc", "http-seq")):
                ratio = results[f"{b}/{kind}"]["median_s"] / results[f"{a}/{kind}"]["median_s"]
                print(f"{name} {a} / {b}: x{ratio:.2f} throughput")
            steps, jobs = conc[kind]
            results[f"http-conc/{kind}"]["mean_batch"] = jobs / steps if steps else 0.0
            print(f"http-conc {name}: {jobs} requests in {steps} batched worker steps, "
                  f"mean batch {jobs / steps if steps else 0:.2f}")
        print(f"load after {os.getloadavg()[0]:.1f}")
        if args.json:
            print(json.dumps(results))
    finally:
        if client is not None:  # the session ends before the server stops
            client.close("success").result()
        running.stop()
    return 0
