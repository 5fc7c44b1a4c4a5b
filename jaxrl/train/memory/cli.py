"""`python launch/memory.py <config.py> [--a.b=c ...]`: print a run's memory plan (docs/memory.md).

Config errors are answered before JAX is imported. The plan needs only abstract shapes
(`jax.eval_shape`); `--compile` also compiles the train step here and uses its memory analysis.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from jaxrl.config import ConfigError, load_config
from jaxrl.config.checks import sequence_capacity
from jaxrl.cpu import simulated_device_flags
from jaxrl.data.tasks import build_task, longest_prompt
from jaxrl.tokenizers import load_tokenizer

ROOT = Path(__file__).resolve().parents[3]


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="launch/memory.py", description=__doc__, allow_abbrev=False)
    p.add_argument("config", nargs="?", default=str(ROOT / "configs" / "default.py"))
    p.add_argument("--budget-gib", type=float, help="memory per device (CPU: for the host) "
                   "instead of the device's own figure")
    p.add_argument("--hf-config", help="a HF config.json for the model when the config's "
                   "init= directory is not on this machine")
    p.add_argument("--prompt-len", type=int, help="longest prompt in tokens (default: measured "
                   "on the task with its tokenizer as the run does, or generate.max_len)")
    p.add_argument("--devices", type=int, help="devices to plan for (default: this machine's)")
    p.add_argument("--platform", choices=("cpu", "gpu", "tpu"),
                   help="plan for this platform (default: this machine's); needs --budget-gib "
                   "when it is not this machine's")
    p.add_argument("--compile", action="store_true", help="compile the train step on this "
                   "machine's devices and use its memory_analysis() for the step")
    return p


def model_config(cfg, hf_config: str | None):
    """(ModelConfig, where it came from): --hf-config, the init directory's, or cfg.model."""
    path = Path(hf_config) if hf_config else Path(cfg.init or "") / "config.json"
    if not hf_config and not (cfg.init and path.is_file()):
        note = f" (init={cfg.init} is not here; pass --hf-config)" if cfg.init else ""
        return cfg.model, "the config's model section" + note
    if not path.is_file():
        raise ConfigError(f"--hf-config: no file {path}")
    from jaxrl.models.hf import config_from_hf

    m = cfg.model
    return config_from_hf(json.loads(path.read_text()), dtype=m.dtype, param_dtype=m.param_dtype,
                          attention_impl=m.attention_impl, remat=m.remat), str(path)


def max_seq_len(cfg, prompt_len: int | None) -> tuple[int, str]:
    """Longest prompt + completion the run sizes for: 1.5x the longest prompt + 8 (as
    `jaxrl.run` sizes the KV cache), or generate.max_len when set."""
    new = cfg.data.max_new_tokens
    if cfg.generate.max_len and not prompt_len:
        return cfg.generate.max_len, "generate.max_len"
    how = f"--prompt-len {prompt_len}"
    if not prompt_len:
        try:
            prompt_len = longest_prompt(cfg, build_task(cfg.data), load_tokenizer(cfg.tokenizer))
        except Exception as e:  # noqa: BLE001 - a missing file or tokenizer: ask for the figure
            raise ConfigError(f"cannot measure the prompts here ({type(e).__name__}: {e}); pass "
                              "--prompt-len N (the longest prompt in tokens)") from None
        how = f"longest of 64 held-out prompts {prompt_len}"
    total = sequence_capacity(prompt_len, new)
    return total, f"{how} x 1.5 + 8 = {total - new}, + {new} new tokens"


def main(argv: list[str] | None = None) -> int:
    args, overrides = _parser().parse_known_args(argv)
    try:
        cfg = load_config(args.config, overrides)
        if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and "XLA_FLAGS" not in os.environ:
            os.environ["XLA_FLAGS"] = simulated_device_flags()  # the devices launch/run.py gets
        print("memory plan: abstract shapes only (jax.eval_shape), nothing allocated...",
              file=sys.stderr, flush=True)
        model_cfg, source = model_config(cfg, args.hf_config)
        seq, seq_source = max_seq_len(cfg, args.prompt_len)
        plan = _plan(cfg, model_cfg, seq, args)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(f"model: {source}; longest sequence {seq} tokens ({seq_source})")
    print(plan.format())
    if plan.fits():
        return 0
    from jaxrl.train.memory.fit import suggest

    print("settings that would make it fit:\n" + "\n".join(f"  - {h}" for h in suggest(plan)))
    return 1


def _plan(cfg, model_cfg, seq: int, args):
    import jax

    from jaxrl.sharding import make_meshes, resolve_mesh_shapes
    from jaxrl.train.memory.plan import plan_memory
    from jaxrl.train.memory.step import GiB, compile_train_step

    n = args.devices or jax.device_count()
    tshape, gshape = resolve_mesh_shapes(cfg.mesh, n)
    compiled = None
    if args.compile:
        if args.devices and args.devices != jax.device_count():
            raise ConfigError("--compile runs on this machine's devices: drop --devices")
        print("compiling the train step (may take minutes)...", file=sys.stderr, flush=True)
        compiled = compile_train_step(cfg, model_cfg, make_meshes(cfg.mesh).trainer,
                                      max_seq_len=seq)
    budget = int(args.budget_gib * GiB) if args.budget_gib else None
    return plan_memory(cfg, model_cfg, trainer_mesh_shape=tshape, generator_mesh_shape=gshape,
                       max_seq_len=seq, budget_bytes=budget, platform=args.platform,
                       colocated=cfg.mesh.colocated or n == 1, compiled=compiled)
