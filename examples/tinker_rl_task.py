"""RL on jaxrl's default task (`pysynth`) through the `tinker` SDK only.

The server is any Tinker-compatible one serving the default experiment's SFT warm start (a random
tiny model scores ~0 on the task, so RL has nothing to push):

    python launch/sft.py configs/default.py --export-hf=/tmp/sft_hf
    python launch/serve.py --base-model /tmp/sft_hf --max-len 256 --port 8000 &
    python examples/tinker_rl_task.py --base-url http://127.0.0.1:8000 --base-model /tmp/sft_hf

Everything that trains or samples goes through the SDK: per step
`save_weights_and_get_sampling_client`, a group of completions per prompt,
`forward_backward(..., "importance_sampling")` on group-centred rewards, `optim_step`. jaxrl is
used on the client side only for what a Tinker user brings themselves: the task's prompts
(`configs/default.py`'s data), its tokenizer (to detokenise) and its reward (run here, in the
local sandbox pool). Held-out pass@1 is measured through the SDK sampler too: the first
`--eval-size` held-out prompts, `--eval-k` samples each at temperature 1 with the same seed at
every evaluation, correct when the reward is 1 (as `jaxrl.rl.evaluator`).
"""

from __future__ import annotations

import argparse
import contextlib
import time

import numpy as np
import tinker
from tinker import types
from tinker_rl import is_datum  # beside this script (its directory is on sys.path)

from jaxrl.config import load_config
from jaxrl.data.tasks import build_task
from jaxrl.rewards import RewardScorer
from jaxrl.sandbox.pool import LocalSandboxPool
from jaxrl.tokenizers import load_tokenizer


class TaskClient:
    """The task's prompts, detokenisation and reward, on the client side."""

    def __init__(self, cfg, scorer):
        self.cfg, self.scorer = cfg, scorer
        self.tokenizer = load_tokenizer(cfg.tokenizer)
        self.task = build_task(cfg.data)
        self.train = self.task.source("train")

    def prompt(self, record) -> list[int]:
        return list(self.task.render(record, self.tokenizer, self.cfg.data.prompt_format))

    def rewards(self, records, token_lists) -> np.ndarray:
        eos = self.tokenizer.eos_id
        texts = [self.tokenizer.decode([t for t in toks if t != eos], errors="replace")
                 for toks in token_lists]
        return np.asarray(self.scorer.score_batch(self.task.reward_items(records, texts)).total,
                          np.float32)


def sample_groups(sc, tc_task: TaskClient, records, n: int, max_tokens: int, seed: int):
    """n completions per record through the SDK sampler; returns (prompts, sequences per record)."""
    params = types.SamplingParams(max_tokens=max_tokens, temperature=1.0, seed=seed,
                                  stop=[tc_task.tokenizer.eos_id])
    prompts = [tc_task.prompt(r) for r in records]
    futures = [sc.sample(types.ModelInput.from_ints(p), n, params) for p in prompts]
    return prompts, [f.result().sequences for f in futures]


def rl_step(tc, task: TaskClient, step: int, args) -> float:
    """One step on `args.prompts` training prompts; returns their samples' mean reward."""
    sc = tc.save_weights_and_get_sampling_client().result()
    n_train = len(task.train)
    records = [task.train[(step * args.prompts + i) % n_train] for i in range(args.prompts)]
    prompts, groups = sample_groups(sc, task, records, args.group, args.max_tokens, seed=step)
    flat_records = [r for r in records for _ in range(args.group)]
    r_PxG = task.rewards(flat_records, [list(s.tokens) for g in groups for s in g]).reshape(
        len(records), args.group)
    data = []
    for prompt, seqs, r_G in zip(prompts, groups, r_PxG, strict=True):
        adv_G = r_G - r_G.mean()
        if not np.any(adv_G):  # all equal: no signal, nothing to send
            continue
        data.extend(is_datum(prompt, seq, adv) for seq, adv in zip(seqs, adv_G, strict=True))
    if data:
        fb = tc.forward_backward(data, "importance_sampling")
        opt = tc.optim_step(types.AdamParams(learning_rate=args.lr))
        fb.result(), opt.result()
    return float(r_PxG.mean())


def held_out_pass1(tc, task: TaskClient, args) -> float:
    """The same prompts and sampling seed at every evaluation: estimates differ by the weights."""
    sc = tc.save_weights_and_get_sampling_client().result()
    records = task.task.eval_records(args.eval_size)
    _, groups = sample_groups(sc, task, records, args.eval_k, args.max_tokens, seed=10_000)
    flat = [r for r in records for _ in range(args.eval_k)]
    r = task.rewards(flat, [list(s.tokens) for g in groups for s in g])
    return float(np.mean(r >= 1.0))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--base-url", required=True)
    p.add_argument("--base-model", required=True, help="the name the server serves")
    p.add_argument("--config", default="configs/default.py", help="the task's experiment")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--prompts", type=int, default=16, help="prompts per step")
    p.add_argument("--group", type=int, default=8, help="samples per prompt")
    p.add_argument("--max-tokens", type=int, default=24)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--lr", type=float, default=2e-3)
    p.add_argument("--eval-size", type=int, default=128, help="held-out prompts (0: no eval)")
    p.add_argument("--eval-k", type=int, default=4)
    p.add_argument("--eval-every", type=int, default=10)
    args = p.parse_args(argv)
    cfg = load_config(args.config, [])

    service = None
    with contextlib.ExitStack() as stack:
        spec = build_task(cfg.data).reward_spec()
        pool = stack.enter_context(LocalSandboxPool()) if spec.needs_pool else None
        task = TaskClient(cfg, stack.enter_context(RewardScorer(spec, pool=pool)))
        try:
            service = tinker.ServiceClient(base_url=args.base_url, api_key="tml-local")
            tc = service.create_lora_training_client(base_model=args.base_model, rank=args.rank,
                                                     seed=0).result()
            start, curve = time.time(), []
            for step in range(args.steps):
                if args.eval_size and step % args.eval_every == 0:
                    acc = held_out_pass1(tc, task, args)
                    print(f"step {step:3d}  held-out pass@1 {acc:.3f}  "
                          f"{time.time() - start:6.1f} s", flush=True)
                curve.append(rl_step(tc, task, step, args))
                print(f"step {step:3d}  reward {curve[-1]:.3f}  {time.time() - start:6.1f} s",
                      flush=True)
            if args.eval_size:
                print(f"step {args.steps:3d}  held-out pass@1 "
                      f"{held_out_pass1(tc, task, args):.3f}", flush=True)
            k = max(1, len(curve) // 5)
            print(f"reward {np.mean(curve[:k]):.3f} (first {k} steps) -> "
                  f"{np.mean(curve[-k:]):.3f} (last {k}); {args.steps} steps in "
                  f"{time.time() - start:.0f} s", flush=True)
        finally:
            if service is not None:
                service.close("success").result()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
