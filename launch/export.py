"""Export a run as a Hugging Face directory: `python launch/export.py runs/<name> OUT_DIR`.

Writes `model.safetensors` + `config.json` (the policy at the latest checkpoint, or `--step N`),
the tokenizer files (copied from the run's Hugging Face tokenizer; a run on jaxrl's character
tokenizer has none) and `generation_config.json` (EOS/pad ids, the run's sampling settings).
`transformers.AutoModelForCausalLM.from_pretrained(OUT_DIR)` loads the result.

A LoRA run (`model.lora.rank > 0`) is written as a PEFT adapter directory (`adapter_config.json`
+ `adapter_model.safetensors`; `peft.PeftModel.from_pretrained(base, OUT_DIR)` loads it onto the
run's `--init` model, or onto `OUT_DIR/base/`, written beside it when the run's base was jaxrl's
own init); `--merge` writes one merged model instead.

Arguments are checked before JAX is imported, so a bad one is answered at once.
"""

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:  # run from a checkout without `pip install -e .`
    sys.path.insert(0, str(ROOT))

DTYPES = ("float32", "bfloat16", "float16")


def _parse(argv):
    p = argparse.ArgumentParser(prog="python launch/export.py", description=__doc__.split("\n")[0],
                                allow_abbrev=False)
    p.add_argument("run_dir", help="the run directory, runs/<name>")
    p.add_argument("out_dir", help="directory to write (must not exist or be empty)")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: latest)")
    p.add_argument("--dtype", choices=DTYPES, default=None,
                   help="tensor dtype (default: the run's parameter dtype)")
    p.add_argument("--merge", action="store_true",
                   help="LoRA run: one merged model (W + s A B) instead of the PEFT adapter "
                        "directory (a full-parameter run is always one model)")
    p.add_argument("--force", action="store_true", help="write into a non-empty OUT_DIR")
    return p.parse_args(argv)


def main(argv: list[str]) -> int:
    args = _parse(argv)
    from jaxrl.config import ConfigError  # no JAX
    from jaxrl.train.run_dir import check_run_dir  # no JAX

    out = Path(args.out_dir)
    try:
        step = check_run_dir(args.run_dir, args.step)
        if out.exists() and not out.is_dir():
            raise ConfigError(f"OUT_DIR {out} exists and is not a directory")
        if out.is_dir() and any(out.iterdir()) and not args.force:
            raise ConfigError(f"OUT_DIR {out} is not empty; choose another or pass --force")
        from jaxrl.models.safetensors_io import CheckpointError
        from jaxrl.train.export import export_run

        try:
            info = export_run(args.run_dir, out, step=step, dtype=args.dtype, merge=args.merge)
        except CheckpointError as e:  # e.g. a form the model has no Hugging Face place for
            raise ConfigError(str(e)) from None
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    what = "PEFT adapter" if info["adapter"] else "model"
    print(f"exported {args.run_dir} step {info['step']} as a {what} ({info['dtype']}) -> {out}")
    print(f"files: {', '.join(info['files'])}")
    print(f"tokenizer: {info['tokenizer']}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
