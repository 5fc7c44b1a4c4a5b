"""Quick look at a checkpoint: `python -m jaxrl.generate --model PATH --prompt "..."`.

The tokenizer is the checkpoint's own (`tokenizer.json` in PATH) unless `--tokenizer` names another
directory or `char` (jaxrl's character tokenizer). Its EOS id stops generation.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxrl.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True, help="local Hugging Face checkpoint directory")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory or 'char'")
    p.add_argument("--chat", action="store_true", help="wrap each prompt in the chat template")
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--temperature", type=float, default=0.0, help="0 = greedy")
    p.add_argument("--top-k", type=int, default=0)
    p.add_argument("--top-p", type=float, default=1.0)
    p.add_argument("-n", type=int, default=1, help="samples per prompt")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--logprobs", action="store_true", help="also print token ids and logprobs")
    return p.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    from jaxrl.generate import SamplingParams, sample
    from jaxrl.models import load_pretrained
    from jaxrl.tokenizers import load_tokenizer

    tok_path = args.tokenizer
    if tok_path is None:
        tok_path = args.model if (Path(args.model) / "tokenizer.json").is_file() else "char"
    tokenizer = load_tokenizer(tok_path)
    if args.chat:
        prompts = [tokenizer.apply_chat_template([{"role": "user", "content": p}])
                   for p in args.prompt]
    else:
        prompts = [tokenizer.encode(p) for p in args.prompt]
    cfg, model = load_pretrained(args.model, args.dtype)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, n=args.n, seed=args.seed)
    start = time.perf_counter()
    completions = sample(model, prompts, sp, eos_ids=[tokenizer.eos_id])
    elapsed = time.perf_counter() - start
    for c in completions:
        print(f"--- prompt {c.request_id} sample {c.sample_index} ({c.num_tokens} tokens, "
              f"{c.finish_reason}, mean logprob "
              f"{sum(c.logprobs) / max(len(c.logprobs), 1):.3f})")
        print(args.prompt[c.request_id] + tokenizer.decode(c.tokens, errors="replace"))
        if args.logprobs:
            print("tokens:", c.tokens)
            print("logprobs:", [round(x, 4) for x in c.logprobs])
    total = sum(c.num_tokens for c in completions)
    print(f"--- {total} tokens in {elapsed:.1f}s (compilation included)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
