"""An RL loop written only against the `tinker` SDK: sample a group per prompt, score each
completion with a reward, importance-sampling loss on group-centred advantages,
`forward_backward`, `optim_step`. It runs against any Tinker-compatible server; without
`--base-url` it starts jaxrl's service in this process on a random tiny model (CPU is enough).

    python examples/tinker_rl.py --steps 30          # in-process jaxrl service, tiny model
    python examples/tinker_rl.py --base-url http://127.0.0.1:8000 --base-model tiny

The reward needs no tokenizer: the share of a completion's tokens that fall in a fixed set of
8 token ids (out of the tiny model's 128, so ~6% at random). Only the lines that start the
in-process server import jaxrl.
"""

from __future__ import annotations

import argparse
import time

import numpy as np
import tinker
from tinker import types

TARGET = frozenset(range(40, 48))
PROMPTS = [[3, 4, 5, 6], [7, 8, 9], [11, 12, 13, 14, 15], [20, 21]]


def reward(tokens: list[int]) -> float:
    return sum(t in TARGET for t in tokens) / max(1, len(tokens))


def is_datum(prompt: list[int], seq, advantage: float) -> types.Datum:
    """The `importance_sampling` datum of one sampled sequence: inputs and targets shifted by one;
    the prompt's targets carry zero logprob and advantage (they are not trained on), each sampled
    token the sampler's logprob and the sequence's advantage."""
    tokens = prompt + list(seq.tokens)
    n_prompt = len(prompt) - 1  # targets before the first sampled token
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.array(tokens[1:], np.int64),
            "logprobs": np.array([0.0] * n_prompt + list(seq.logprobs), np.float32),
            "advantages": np.array([0.0] * n_prompt + [advantage] * len(seq.tokens), np.float32)})


def rl_step(tc, group: int, max_tokens: int, lr: float, seed: int) -> float:
    """One step; returns the mean reward of the samples it trained on."""
    sc = tc.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed, stop=[])
    futures = [sc.sample(types.ModelInput.from_ints(p), group, params) for p in PROMPTS]
    data, rewards = [], []
    for prompt, fut in zip(PROMPTS, futures, strict=True):
        seqs = fut.result().sequences
        r = np.array([reward(s.tokens) for s in seqs], np.float32)
        rewards.extend(r)
        data.extend(is_datum(prompt, seq, adv) for seq, adv in zip(seqs, r - r.mean(), strict=True))
    fb = tc.forward_backward(data, "importance_sampling")
    opt = tc.optim_step(types.AdamParams(learning_rate=lr))
    fb.result(), opt.result()
    return float(np.mean(rewards))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", default=None, help="a running server (default: start one here)")
    p.add_argument("--base-model", default="tiny")
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=8)
    p.add_argument("--rank", type=int, default=8)
    p.add_argument("--lr", type=float, default=2e-2)
    args = p.parse_args(argv)

    running = None
    if args.base_url is None:
        from jaxrl.service.backend import Backend
        from jaxrl.service.server import Running, Service

        running = Running(Service(Backend.load(args.base_model, max_len=64,
                                               num_slots=len(PROMPTS) * args.group)))
        args.base_url = running.url
    service = None
    try:
        service = tinker.ServiceClient(base_url=args.base_url, api_key="tml-local")
        tc = service.create_lora_training_client(base_model=args.base_model, rank=args.rank,
                                                 seed=0).result()
        start, curve = time.time(), []
        for step in range(args.steps):
            curve.append(rl_step(tc, args.group, args.max_tokens, args.lr, seed=step))
            print(f"step {step:3d}  reward {curve[-1]:.3f}  {time.time() - start:6.1f} s",
                  flush=True)
        k = max(1, len(curve) // 5)
        print(f"reward {np.mean(curve[:k]):.3f} (first {k} steps) -> {np.mean(curve[-k:]):.3f} "
              f"(last {k}); {args.steps} steps in {time.time() - start:.0f} s", flush=True)
    finally:
        if service is not None:
            service.close("success").result()  # stops its heartbeat before the server goes
        if running is not None:
            running.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
