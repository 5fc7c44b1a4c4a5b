"""The policy's parameters as a run builds them: its model config (`cfg.model`, or the `init`
model's own), the initial parameters (Hugging Face weights, or the seeded init plus the cached SFT
warm start), the frozen KL reference, and the digest that ties a LoRA checkpoint to its base."""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging

import jax
import numpy as np

from jaxrl.config import ConfigError, RunConfig
from jaxrl.models import create_model
from jaxrl.models.hf import config_from_hf, load_pretrained
from jaxrl.models.hub import resolve
from jaxrl.models.safetensors_io import CheckpointError
from jaxrl.train.sft import warm_start
from jaxrl.train.state import params_from_model
from jaxrl.train.trainer import Trainer, tree_bytes

log = logging.getLogger("jaxrl")


def model_config(cfg: RunConfig, tokenizer):
    """`cfg.model`, or the Hugging Face model's own config when `cfg.init` names one (a local
    directory or a Hub id, `jaxrl.models.hub.resolve`)."""
    model_cfg = cfg.model
    if cfg.init:
        hf = json.loads((resolve(cfg.init, what="init") / "config.json").read_text())
        try:
            model_cfg = config_from_hf(
                hf, dtype=cfg.model.dtype, param_dtype=cfg.model.param_dtype,
                attention_impl=cfg.model.attention_impl, remat=cfg.model.remat,
                lora=cfg.model.lora)
        except CheckpointError as e:  # an architecture or setting jaxrl does not implement
            raise ConfigError(f"init={cfg.init!r}: {e}") from None
    if model_cfg.vocab_size < tokenizer.vocab_size:
        raise ConfigError(
            f"model.vocab_size={model_cfg.vocab_size} is smaller than the tokenizer's "
            f"vocabulary ({tokenizer.vocab_size})")
    return model_cfg


def recorded_config(cfg: RunConfig, model_cfg) -> RunConfig:
    """The config a run records in config.json (and compares on `--resume`): `cfg` with the
    `model` section it trains (an `--init` model's own shape, not `cfg.model`'s defaults)."""
    return dataclasses.replace(cfg, model=model_cfg)


def initial_params(cfg: RunConfig, mesh, tokenizer, task, model_cfg, processes):
    """Params on the trainer mesh and their metrics: HF weights, or random init plus the cached
    SFT warm start."""
    # LoRA: this is the base (the trainer draws or loads the adapters)
    model_cfg = dataclasses.replace(model_cfg, lora=type(model_cfg.lora)())
    if cfg.init:
        if cfg.data.sft.steps:  # the warm start trains jaxrl's seeded init only
            log.warning("init=%r gives the starting weights: the SFT warm start "
                        "(data.sft.steps=%d) is skipped; --data.sft.steps=0 starts from it "
                        "without this note", cfg.init, cfg.data.sft.steps)
        _, model = load_pretrained(resolve(cfg.init, what="init"), mesh=mesh, role="trainer",
                                   dtype=model_cfg.param_dtype)
        return params_from_model(model), {}
    processes.check_sft_cached(cfg, model_cfg, tokenizer)
    # SFT shows its own progress display (jaxrl.progress): no second line per step
    params, info = warm_start(model_cfg, cfg.data, mesh=mesh, tokenizer=tokenizer, task=task)
    if params is None:
        model = create_model(model_cfg, mesh=mesh, role="trainer", seed=cfg.seed)
        return params_from_model(model), {}
    return params, {"sft/cache_hit": float(info.get("cache_hit", False)),
                    "sft/wall_s": float(info.get("wall_s", 0.0))}


def reference_params(cfg: RunConfig, mesh, tokenizer, task, model_cfg, processes, initial):
    """The frozen reference policy for the KL term (None when not needed): `train.ref_init`'s
    HF weights, else the run's initial policy. On resume it is rebuilt the way the initial
    policy was (HF weights, the cached SFT warm start, or the seeded random init)."""
    if not cfg.train.needs_reference or model_cfg.lora.enabled:  # LoRA: the base is the ref
        return None
    if cfg.train.ref_init:
        _, model = load_pretrained(resolve(cfg.train.ref_init, what="train.ref_init"),
                                   mesh=mesh, role="trainer",
                                   dtype=model_cfg.param_dtype)
        return params_from_model(model)
    if initial is None:
        initial, _ = initial_params(cfg, mesh, tokenizer, task, model_cfg, processes)
    return initial


def base_fingerprint(base: dict) -> str:
    """A digest of a LoRA run's frozen base: the first 64 values of every leaf, as bytes (the
    same on any mesh shape; cheap to read off the devices)."""
    digest = hashlib.sha256()
    for path, leaf in sorted(jax.tree_util.tree_flatten_with_path(base)[0],
                             key=lambda kv: jax.tree_util.keystr(kv[0])):
        digest.update(jax.tree_util.keystr(path).encode())
        digest.update(np.asarray(jax.device_get(leaf.reshape(-1)[:64])).tobytes())
    return digest.hexdigest()[:16]


def register_lora_base(ckpt, trainer, cfg: RunConfig) -> None:
    """A LoRA checkpoint holds the adapters and their optimiser state; it records which base
    they belong to (`init`, or the seeded init / SFT warm start, and a digest of the weights),
    and `--resume` refuses a base that differs (e.g. a changed `--init` directory)."""
    if trainer.frozen is None:
        return
    info = {"init": cfg.init or f"seeded init (seed {cfg.train.seed}) + SFT warm start",
            "fingerprint": base_fingerprint(trainer.frozen)}

    def check(saved: dict) -> None:
        if saved and saved.get("fingerprint") != info["fingerprint"]:
            raise ConfigError(
                f"the LoRA checkpoint's adapters were trained on another base: saved "
                f"{saved.get('init')!r} (fingerprint {saved.get('fingerprint')}), now "
                f"{info['init']!r} (fingerprint {info['fingerprint']}); resume with the same "
                "--init (or model and seed) the run started with")

    ckpt.register("lora_base", get=lambda: info, set=check)


def build_trainer(cfg: RunConfig, mesh, tokenizer, task, model_cfg, processes, *,
                  resume: bool) -> tuple[Trainer, dict]:
    """(the run's Trainer on `mesh`, the SFT warm start's metrics). Its state is the initial
    policy; with `resume` the caller restores the checkpoint into it (a LoRA checkpoint holds
    the adapters only: the base is built here as it was)."""
    params, sft_metrics = None, {}
    if not resume or model_cfg.lora.enabled:
        params, sft_metrics = initial_params(cfg, mesh, tokenizer, task, model_cfg, processes)
    ref = reference_params(cfg, mesh, tokenizer, task, model_cfg, processes, params)
    trainer = Trainer(model_cfg, cfg.train, mesh, params=params, ref_params=ref)
    if trainer.ref_params is not None:
        log.info("reference policy: %.1f MiB on the trainer mesh",
                 tree_bytes(trainer.ref_params) / 2**20)
    return trainer, ({} if resume else sft_metrics)
