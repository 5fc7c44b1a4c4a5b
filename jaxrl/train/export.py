"""A run directory as a model: its config, its latest (or any) checkpoint's policy, and its export
as a Hugging Face directory (`launch/export.py`, `python -m jaxrl.generate --model runs/<name>`).

A run directory holds `config.json` (the `RunConfig`, read back by `run_dir.run_config`) and
`checkpoints/<step>/` (orbax, the whole `TrainState`). Only the policy parameters are read back
(a partial restore: no optimiser state is loaded), as host arrays. A LoRA run's checkpoint holds
the adapters only: its frozen base is rebuilt the way the run built it (`init.initial_params`:
the `init` model, or the seeded init and SFT warm start) and checked against the digest the
checkpoint recorded. Its export is a PEFT adapter directory, or one merged model.
"""

from __future__ import annotations

import dataclasses
import json
import shutil
from pathlib import Path

import jax
import numpy as np
import orbax.checkpoint as ocp
from flax import nnx

from jaxrl.config import ConfigError, MeshConfig, RunConfig
from jaxrl.config.data import task_names
from jaxrl.data.tasks import build_task
from jaxrl.models import lora
from jaxrl.models.hf import save_adapter, save_pretrained
from jaxrl.models.hub import resolve
from jaxrl.models.transformer import Transformer
from jaxrl.sharding import make_meshes
from jaxrl.tokenizers import load_tokenizer
from jaxrl.train.init import base_fingerprint, initial_params, model_config
from jaxrl.train.run_dir import check_run_dir, run_config
from jaxrl.train.state import model_graphdef, params_from_model, trainable

# files of a Hugging Face tokenizer directory that travel with an export
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json", "merges.txt",
                   "added_tokens.json", "tokenizer.model")


def tokenizer_dir(cfg: RunConfig) -> Path | None:
    """The run's Hugging Face tokenizer directory, or None for the character tokenizer."""
    name = cfg.tokenizer
    if name == "auto":
        name = "char" if cfg.init is None else cfg.init
    if name in (None, "char"):
        return None
    path = resolve(name, what="tokenizer", need="tokenizer.json")
    return path.parent if path.is_file() else path


def load_run(run_dir: str | Path, step: int | None = None):
    """(run config, model config, model, step): the policy at checkpoint `step` (default: the
    latest), on the default device in the run's master parameter dtype."""
    step = check_run_dir(run_dir, step)
    cfg = run_config(run_dir)
    tokenizer = load_tokenizer(cfg.tokenizer, init=cfg.init)
    model_cfg = model_config(cfg, tokenizer)
    graphdef, abstract = model_graphdef(model_cfg, cfg.train)
    abstract_params = trainable(nnx.to_pure_dict(abstract), model_cfg)  # LoRA: the adapters
    item = {"params": jax.tree.map(lambda a: np.zeros(a.shape, a.dtype), abstract_params)}
    restore_args = jax.tree.map(lambda a: ocp.RestoreArgs(restore_type=np.ndarray), item)
    args = {"state": ocp.args.PyTreeRestore(item=item, restore_args=restore_args,
                                            partial_restore=True)}
    if model_cfg.lora.enabled:
        args["extra"] = ocp.args.JsonRestore()  # the base's digest (init.register_lora_base)
    manager = ocp.CheckpointManager(Path(run_dir).absolute() / "checkpoints")
    try:
        out = manager.restore(step, args=ocp.args.Composite(**args))
    finally:
        manager.close()
    params = jax.tree.map(np.asarray, out["state"]["params"])
    if model_cfg.lora.enabled:
        # the base in the trainer's master dtype (train.param_dtype), as the run held it
        saved = cfg.train.precision(model_cfg.param_dtype, model_cfg.dtype, "cpu")[0]
        base = lora_base(cfg, dataclasses.replace(model_cfg, param_dtype=saved), tokenizer)
        recorded = ((out.get("extra") or {}).get("lora_base") or {}).get("fingerprint")
        if recorded is not None and base_fingerprint(base) != recorded:
            raise ConfigError(
                f"{run_dir}: checkpoint {step}'s adapters were trained on another base than the "
                f"one rebuilt from the run's config (init={cfg.init!r}, seed={cfg.seed}): digest "
                f"{base_fingerprint(base)}, recorded {recorded}; export with the base "
                "the run started from")
        params = lora.join(base, params)
    else:
        # the master dtype the trainer kept (train.param_dtype); remat is a training setting
        saved = np.dtype(jax.tree.leaves(params)[0].dtype).name
    model_cfg = dataclasses.replace(model_cfg, param_dtype=saved, remat=False)
    graphdef, abstract = model_graphdef(model_cfg, cfg.train)
    state = nnx.to_pure_dict(abstract)
    jax.tree.map(lambda a, b: _check_shape(a, b, run_dir, step), state, params)
    nnx.replace_by_pure_dict(abstract, params)
    return cfg, model_cfg, nnx.merge(graphdef, abstract), step


class _OneProcess:
    """`initial_params`' view of the processes when one process rebuilds a base."""

    multi = False

    def check_sft_cached(self, *args) -> None:
        return None


def lora_base(cfg: RunConfig, model_cfg, tokenizer) -> dict:
    """The frozen base of a LoRA run as host arrays in `model_cfg.param_dtype`, rebuilt the way
    the run built it (`initial_params` on one device: the `init` model, the SFT warm start
    from its cache -- trained again when the cache is gone -- or the seeded init)."""
    mesh = make_meshes(MeshConfig(trainer=(1, 1), generator=(1, 1))).trainer
    task = None
    if cfg.data.sft.steps:  # the base is the SFT warm start, trained on the run's task
        if cfg.data.task not in task_names():
            raise ConfigError(
                f"data.task={cfg.data.task!r}: this LoRA run's base is jaxrl's seeded init plus "
                f"an SFT warm start on that task, which only the process that ran it registered "
                f"(jaxrl.api.train or an experiment file's register_task): register it in this "
                f"process (import that file, or call export_run after train) to rebuild the "
                f"base; registered here: {task_names()}")
        task = build_task(cfg.data)
    params, _ = initial_params(cfg, mesh, tokenizer, task, model_cfg, _OneProcess())
    dtype = np.dtype(model_cfg.param_dtype)
    return jax.tree.map(lambda x: np.asarray(jax.device_get(x)).astype(dtype), params)


def _check_shape(want, got, run_dir, step) -> None:
    if tuple(want.shape) != tuple(got.shape):
        raise ConfigError(f"{run_dir}: checkpoint {step} holds a parameter of shape "
                          f"{tuple(got.shape)} where the run's model has {tuple(want.shape)}")


def generation_config(cfg: RunConfig, tokenizer) -> dict:
    """`generation_config.json`: the run's EOS/pad ids and its sampling settings."""
    gen = cfg.generate
    eos = list(dict.fromkeys(tokenizer.eos_ids))  # Gemma-it: <eos> and <end_of_turn>
    out = {"eos_token_id": eos[0] if len(eos) == 1 else eos, "pad_token_id": tokenizer.pad_id,
           "max_new_tokens": cfg.data.max_new_tokens}
    bos = getattr(tokenizer, "bos_id", None)
    if bos is not None:
        out["bos_token_id"] = bos
    if gen.temperature > 0:
        out.update(do_sample=True, temperature=gen.temperature)
        if gen.top_p < 1.0:
            out["top_p"] = gen.top_p
        out["top_k"] = gen.top_k if gen.top_k > 0 else 0
    else:
        out["do_sample"] = False
    return out


def export_run(run_dir: str | Path, out_dir: str | Path, *, step: int | None = None,
               dtype: str | None = None, merge: bool = False) -> dict:
    """Write checkpoint `step` (default latest) of `run_dir` as a Hugging Face directory:
    `model.safetensors` + `config.json` (in `dtype`, default the run's parameter dtype), the
    tokenizer files (for a Hugging Face tokenizer) and `generation_config.json`.

    A LoRA run (`model.lora.rank > 0`) is written as a PEFT adapter directory
    (`adapter_config.json` + `adapter_model.safetensors`, float32; its base_model_name_or_path is
    the run's `init`); a run whose base is no Hugging Face model (the seeded init or SFT warm
    start) also gets that base, in `dtype`, under `base/`, and the adapter names it. `merge`:
    one merged model (`W + s A B`) instead. Returns what it wrote: {"step", "dtype", "files",
    "tokenizer", "adapter"}."""
    out_dir = Path(out_dir)
    cfg, model_cfg, model, step = load_run(run_dir, step)
    dtype = dtype or model_cfg.param_dtype
    adapter = model_cfg.lora.enabled and not merge
    if adapter:
        base_name = cfg.init
        if base_name is None:  # the base exists only in jaxrl: write it beside the adapter
            plain_cfg = dataclasses.replace(model_cfg, lora=type(model_cfg.lora)())
            graphdef, state = nnx.split(
                nnx.eval_shape(lambda: Transformer(plain_cfg, rngs=nnx.Rngs(0))))
            nnx.replace_by_pure_dict(state, lora.split(params_from_model(model))[0])
            base = nnx.merge(graphdef, state)
            base_name = str(save_pretrained(base, plain_cfg, out_dir / "base", dtype=dtype)
                            .absolute())
        save_adapter(model, out_dir, base_model_name_or_path=base_name)
    else:
        save_pretrained(model, model_cfg, out_dir, dtype=dtype)
    tok_dir = tokenizer_dir(cfg)
    tokenizer = load_tokenizer(cfg.tokenizer, init=cfg.init)
    if tok_dir is not None:
        for name in TOKENIZER_FILES:
            if (tok_dir / name).is_file():
                shutil.copyfile(tok_dir / name, out_dir / name)
        tok_note = f"copied from {tok_dir}"
    else:
        tok_note = ("none: the run uses jaxrl's character tokenizer, which has no Hugging Face "
                    "form; encode with jaxrl.tokenizers.CharTokenizer")
    (out_dir / "generation_config.json").write_text(
        json.dumps(generation_config(cfg, tokenizer), indent=2))
    return {"step": step, "dtype": "float32 (adapters)" if adapter else str(dtype),
            "tokenizer": tok_note, "adapter": adapter,
            "files": sorted(p.name for p in out_dir.iterdir())}
