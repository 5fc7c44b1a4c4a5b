"""Checks that span config sections, in one place. `RunConfig` runs them on construction (so a
config file, an override or `dataclasses.replace` that breaks one fails before any work), and
`jaxrl.run` runs `check_model_lengths` again once the model and the prompts are known.

Each failure names every key involved and how to fix it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import math
import threading
import warnings
from pathlib import Path

from jaxrl.config.base import ConfigError, ConfigWarning


def check_finite(obj, prefix: str = "") -> None:
    """No float option is NaN or infinite (none documents such a value)."""
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if dataclasses.is_dataclass(value):
            check_finite(value, f"{prefix}{f.name}.")
        elif isinstance(value, float) and not math.isfinite(value):
            raise ConfigError(f"{prefix}{f.name}={value!r} is not valid; it must be a finite "
                              "number")


_DEFER = threading.local()


@contextlib.contextmanager
def deferred():
    """Inside: `RunConfig` skips these checks (overrides are applied one at a time, and a later
    one may fix what an earlier one alone breaks); the caller runs `check_run` at the end."""
    _DEFER.depth = getattr(_DEFER, "depth", 0) + 1
    try:
        yield
    finally:
        _DEFER.depth -= 1


def checks_deferred() -> bool:
    return getattr(_DEFER, "depth", 0) > 0


def check_run(cfg) -> None:
    """Everything that can be checked from the config alone."""
    check_finite(cfg)
    if cfg.data.task == "records" and not (cfg.data.paths or cfg.data.hf_dataset):
        raise ConfigError("data.task='records' reads data.paths (JSONL / Parquet) or "
                          "data.hf_dataset (a saved `datasets` directory or a Hub id); set one")
    if (not cfg.name or cfg.name in (".", "..") or "/" in cfg.name or "\\" in cfg.name
            or "\0" in cfg.name):
        raise ConfigError(f"name={cfg.name!r} is not valid; it must be a single path component "
                          f"(the run directory is run_dir/name = {cfg.run_dir}/<name>)")
    train, pipe, data, gen = cfg.train, cfg.pipeline, cfg.data, cfg.generate
    updates = pipe.steps * train.mini_batches * train.epochs
    if train.schedule == "cosine" and train.total_steps < updates:
        raise ConfigError(
            f"train.schedule='cosine' with train.total_steps={train.total_steps} ends before the "
            f"run's {updates} updates (pipeline.steps={pipe.steps} x train.mini_batches="
            f"{train.mini_batches} x train.epochs={train.epochs}; the learning rate would sit at "
            f"its floor for the rest); set --train.total_steps={updates}")
    if train.mini_batches > data.prompts_per_step:
        raise ConfigError(
            f"train.mini_batches={train.mini_batches} is more than the groups per step "
            f"(data.prompts_per_step={data.prompts_per_step}); groups are never split across "
            f"mini-batches: use --train.mini_batches<={data.prompts_per_step}")
    ref = train.ref_init
    local = ref and (Path(ref).exists() or ref.startswith((".", "/", "~")) or ref.count("/") != 1)
    if local and not (Path(ref).expanduser() / "config.json").is_file():
        raise ConfigError(
            f"train.ref_init={ref!r} is not a Hugging Face model directory (no config.json there) "
            "nor a Hub id (org/name); point it at one, or leave it unset to use the initial "
            "policy")
    if ref and cfg.model.lora.enabled:
        raise ConfigError(
            f"train.ref_init={ref!r} with model.lora.rank={cfg.model.lora.rank}: a LoRA run's "
            "reference policy is its frozen base (the adapters at zero); unset train.ref_init")
    if data.group_size == 1:
        warnings.warn(
            f"data.group_size=1: every advantage is zero (train.advantage={train.advantage!r} "
            "compares the samples of one prompt with each other, and a group of one has nothing "
            "to compare), so RL learns nothing; use --data.group_size=2 or more (8 is usual)",
            ConfigWarning, stacklevel=2)
    rollouts = data.prompts_per_step * data.group_size
    if train.micro_batches > rollouts:
        raise ConfigError(
            f"train.micro_batches={train.micro_batches} is more than the rollouts per step "
            f"(data.prompts_per_step x data.group_size = {rollouts}): some micro-batches would be "
            f"empty; use --train.micro_batches<={rollouts}")
    n = cfg.dist.num_processes
    if n and data.prompts_per_step % n:
        raise ConfigError(
            f"data.prompts_per_step={data.prompts_per_step} must be a multiple of "
            f"dist.num_processes={n}: each process draws an equal share")
    mesh = cfg.mesh
    if (pipe.rebalance == "auto" or pipe.rebalance_every) and (
            mesh.colocated or n or mesh.cpu_cores == "split"):
        raise ConfigError(
            "pipeline.rebalance / rebalance_every move chips between the trainer and the "
            "generator: they need separate roles on one set of devices in one process "
            "(mesh.colocated=false, mesh.cpu_cores='shared', dist.num_processes unset); got "
            f"colocated={mesh.colocated}, cpu_cores={mesh.cpu_cores!r}, num_processes={n}")
    if cfg.init is None:
        check_model_lengths(cfg, cfg.model)
    if gen.max_len and gen.max_len <= data.max_new_tokens:
        raise ConfigError(
            f"generate.max_len={gen.max_len} leaves no room for a prompt before "
            f"data.max_new_tokens={data.max_new_tokens}; raise generate.max_len or set it to 0 "
            "(automatic)")
    if gen.prefill_devices:
        check_prefill_devices(cfg)
    if gen.min_tokens > data.max_new_tokens:
        raise ConfigError(
            f"generate.min_tokens={gen.min_tokens} is more than data.max_new_tokens="
            f"{data.max_new_tokens}: no rollout could reach it; lower generate.min_tokens or "
            "raise data.max_new_tokens")


def check_prefill_devices(cfg) -> None:
    """`generate.prefill_devices` against the generator mesh (when its shape is given; an
    automatic one is checked when the mesh is built) and live rebalancing."""
    p, shape = cfg.generate.prefill_devices, cfg.mesh.generator
    if shape is not None:
        n, tp = shape[0] * shape[1], shape[1]
        valid = list(range(tp, n, tp))
        if p not in valid:
            raise ConfigError(
                f"generate.prefill_devices={p} does not split mesh.generator={shape[0]}x"
                f"{shape[1]} ({n} devices, tp={tp}); valid: {valid or 'none'} (a multiple of "
                "tp that leaves at least one tp group to decode), or 0 (colocated prefill)")
    if cfg.pipeline.rebalance == "auto" or cfg.pipeline.rebalance_every:
        raise ConfigError(
            f"generate.prefill_devices={p} with pipeline.rebalance={cfg.pipeline.rebalance!r} / "
            f"rebalance_every={cfg.pipeline.rebalance_every}: live rebalancing resizes the "
            "generator mesh, which a fixed prefill split does not follow; set "
            "--generate.prefill_devices=0 or turn rebalancing off")


def check_model_lengths(cfg, model_cfg, max_prompt: int = 1) -> None:
    """Prompt plus response (and the SFT rows) fit the model's positions."""
    limit = model_cfg.max_position_embeddings
    limit_name = "max_position_embeddings"
    need = max_prompt + cfg.data.max_new_tokens
    if need > limit:
        raise ConfigError(
            f"a prompt of {max_prompt} tokens plus data.max_new_tokens={cfg.data.max_new_tokens} "
            f"is {need} positions, more than the model's {limit_name}={limit}; lower "
            "data.max_new_tokens or use shorter prompts")
    if cfg.generate.max_len > limit:
        raise ConfigError(
            f"generate.max_len={cfg.generate.max_len} is more than the model's "
            f"{limit_name}={limit}; set --generate.max_len<={limit} or 0 (automatic)")
    if cfg.data.sft.steps and cfg.data.sft.max_len > limit:
        raise ConfigError(
            f"data.sft.max_len={cfg.data.sft.max_len} is more than the model's "
            f"{limit_name}={limit}; set --data.sft.max_len<={limit}")


def sequence_capacity(longest_prompt: int, max_new_tokens: int) -> int:
    """Positions a run sizes its KV cache and memory plan for (`generate.max_len=0`): 1.5x the
    longest held-out prompt + 8, plus the completion."""
    return int(longest_prompt * 1.5) + 8 + max_new_tokens
