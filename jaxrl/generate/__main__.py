"""Quick look at a checkpoint: `python -m jaxrl.generate --model PATH --prompt "..."`.

PATH is a Hugging Face model directory, a Hub id (`org/name`, from the local Hugging Face cache,
or downloaded when online), or a jaxrl run directory (`runs/<name>`: its latest checkpoint, or
`--step N`). The tokenizer is the model's own (`tokenizer.json` in PATH; a run's own tokenizer)
unless `--tokenizer` names another directory, Hub id or `char` (jaxrl's character tokenizer).
Its EOS id stops generation. `--chat` renders each prompt as a user message with the tokenizer's
chat template.
"""

from __future__ import annotations

import argparse
import sys
import time

from jaxrl.config import ConfigError
from jaxrl.generate import SamplingParams, sample
from jaxrl.generate.api import encode_prompts
from jaxrl.models import load_pretrained
from jaxrl.models.hub import resolve
from jaxrl.tokenizers import load_tokenizer, model_tokenizer
from jaxrl.train.export import load_run
from jaxrl.train.run_dir import is_run_dir


def _parse(argv):
    p = argparse.ArgumentParser(prog="python -m jaxrl.generate", description=__doc__.split("\n")[0])
    p.add_argument("--model", required=True,
                   help="Hugging Face model directory, Hub id (org/name) or run directory")
    p.add_argument("--step", type=int, default=None,
                   help="with a run directory: its checkpoint step (default: the latest)")
    p.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    p.add_argument("--tokenizer", default=None, help="tokenizer directory, Hub id or 'char'")
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


def _load(args):
    """(tokenizer, model) for `--model` / `--tokenizer` / `--step`."""
    if is_run_dir(args.model):
        cfg, _, model, step = load_run(args.model, args.step)
        if args.dtype != "float32":
            raise ValueError("--dtype applies to Hugging Face models; a run loads in its own")
        print(f"--- {args.model}: checkpoint step {step}")
        tok = args.tokenizer or cfg.tokenizer
        return load_tokenizer(tok, init=cfg.init), model
    if args.step is not None:
        raise ValueError("--step applies to a run directory (runs/<name>)")
    path = resolve(args.model, what="--model")
    return model_tokenizer(path, args.tokenizer), load_pretrained(path, args.dtype)[1]


def main(argv: list[str] | None = None) -> int:
    args = _parse(sys.argv[1:] if argv is None else argv)
    try:
        tokenizer, model = _load(args)
        prompts = encode_prompts(args.prompt, tokenizer, chat=args.chat)
    except (ConfigError, TypeError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_k=args.top_k, top_p=args.top_p, n=args.n, seed=args.seed)
    start = time.perf_counter()
    completions = sample(model, prompts, sp, eos_ids=tokenizer.eos_ids)
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
