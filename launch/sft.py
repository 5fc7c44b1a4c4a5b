"""SFT warm start + held-out evaluation, alone (the number behind docs/benchmarks.md "SFT").

    python launch/sft.py configs/default.py --data.sft.steps=200 --data.sft.batch_size=32

Trains (or loads from the cache under data.sft.cache_dir) the warm-started model of the
experiment, evaluates pass@1 / pass@k on the held-out split and prints one JSON line. Runs on
one device (the fastest layout for a tiny model on CPU).

`--export-hf=DIR` also writes the warm-started model as a Hugging Face directory (`config.json` +
`model.safetensors`, float32; no tokenizer files: the character tokenizer has no Hugging Face
form), e.g. to serve it with `python launch/serve.py --base-model DIR` (docs/service.md).
"""

import contextlib
import json
import sys
import time

USAGE = "usage: python launch/sft.py <config.py> [--key=value ...] [--export-hf=DIR]"


def main(argv: list[str]) -> None:
    if any(a in ("-h", "--help") for a in argv):
        print(f"{USAGE}\n\n{__doc__.strip()}\n\nThe config keys and their values: "
              "python launch/run.py --config <config.py> --help")
        return
    export = [a for a in argv if a.startswith("--export-hf=")]
    argv = [a for a in argv if not a.startswith("--export-hf=")]
    export_dir = export[-1].split("=", 1)[1] if export else None
    if not argv or argv[0].startswith("--"):
        raise SystemExit(f"{USAGE}\n(--help says more)")
    from jaxrl.config import ConfigError, load_config  # no JAX: bad input is answered first

    try:
        cfg = load_config(argv[0], argv[1:])
    except ConfigError as e:
        raise SystemExit(f"error: {e}") from None
    from jaxrl.data.sources import RecordError

    try:
        _warm_start_and_evaluate(cfg, export_dir)
    except (ConfigError, RecordError) as e:  # the model, the tokenizer or the data
        raise SystemExit(f"error: {e}") from None


def _warm_start_and_evaluate(cfg, export_dir: str | None) -> None:
    import jax

    from jaxrl.data.tasks import build_task
    from jaxrl.rewards import RewardScorer
    from jaxrl.rl.evaluator import evaluate
    from jaxrl.sandbox.pool import LocalSandboxPool
    from jaxrl.sharding import make_mesh
    from jaxrl.tokenizers import load_tokenizer
    from jaxrl.train.sft import sft_model, warm_start

    tokenizer = load_tokenizer(cfg.tokenizer)
    task = build_task(cfg.data)
    mesh = make_mesh((1, 1), "trainer", jax.devices()[:1])
    t0 = time.perf_counter()
    params, info = warm_start(cfg.model, cfg.data, mesh=mesh, tokenizer=tokenizer, task=task)
    if params is None:
        raise SystemExit("data.sft.steps is 0: nothing to warm-start")
    sft_s = time.perf_counter() - t0
    if export_dir:
        from jaxrl.models.hf import save_pretrained

        save_pretrained(sft_model(cfg.model, params), cfg.model, export_dir)
    spec = task.reward_spec()
    # a sandbox pool only for rewards that run code (e.g. arith or gsm8k need none)
    with contextlib.ExitStack() as stack:
        pool = stack.enter_context(LocalSandboxPool()) if spec.needs_pool else None
        scorer = stack.enter_context(RewardScorer(spec, pool=pool))
        metrics = evaluate(sft_model(cfg.model, params), task, tokenizer, scorer, cfg=cfg.data,
                           seed=cfg.data.seed)
    print(json.dumps({"cache_hit": info["cache_hit"], "cache_path": info["cache_path"],
                      "sft_wall_s": round(info["wall_s"], 1), "total_sft_s": round(sft_s, 1),
                      "losses": info["losses"], **metrics,
                      "sandbox_tier": pool.tier if pool is not None else None,
                      "exported_to": export_dir}))


if __name__ == "__main__":
    main(sys.argv[1:])
