"""SFT warm start: cross-entropy on task demonstrations with the trainer's state and optimiser.

    params, info = warm_start(model_cfg, data_cfg, mesh=meshes.trainer, tokenizer=tok)
    state = init_train_state(model_cfg, train_cfg, meshes.trainer, params=params)   # then RL

A tiny model trained from scratch solves nothing, so every GRPO group would have zero reward
variance. A few hundred supervised steps on the task's reference completions bring it to a solve
rate where groups differ. The loss is the mean negative log-likelihood of the demonstration tokens
(and EOS) given the prompt; it reuses `TrainState`, `make_optimizer` (AdamW, warmup + cosine) and
the trainer's own jitted step (`make_train_step(objective="sft")`, with its non-finite guard).

Cache: `warm_start` stores the result under `<cache_dir>/sft-<key>/` where `key` hashes the model
config, the task settings that shape the demonstrations (and the data files' sizes and mtimes),
the tokenizer and the SFT settings. The directory is written under a temporary name and renamed
only when complete, so an interrupted run never leaves a cache entry that a later run would use.
The entry also records `code_stamp()`; a hit made by other code is used, with a warning.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path

import jax
import numpy as np
from flax import nnx
from jax.sharding import Mesh

from jaxrl.config import DataConfig, ModelConfig, TrainConfig, to_dict
from jaxrl.data.pipeline import PromptIterator
from jaxrl.data.tasks import Task, build_task, resolve_format
from jaxrl.progress import Progress
from jaxrl.rounding import round_up
from jaxrl.train.batch import Batch
from jaxrl.train.state import init_train_state, model_graphdef, train_state_shardings
from jaxrl.train.step import make_train_step

log = logging.getLogger(__name__)

# DataConfig fields that do not change the demonstrations a warm start sees (not in the cache key).
_NOT_IN_KEY = ("epochs", "shuffle", "prompts_per_step", "group_size", "max_new_tokens",
               "eval_every", "pass_k", "eval_temperature", "filter_zero_variance", "skip_solved",
               "skip_unsolved", "solve_rate_min_samples")
_SFT_NOT_IN_KEY = ("cache", "cache_dir", "log_every")


def sft_train_config(sft) -> TrainConfig:
    """The trainer settings of a warm start (the lm-head backward recomputes its softmax)."""
    return TrainConfig(lr=sft.lr, warmup_steps=min(sft.warmup_steps, max(sft.steps - 1, 0)),
                       schedule="cosine", total_steps=max(sft.steps, 1), min_lr_ratio=0.1,
                       weight_decay=sft.weight_decay, max_grad_norm=1.0, seed=sft.seed,
                       logprob_chunk=128, lm_head_keep_mb=0)


def sft_rows(task: Task, records: Sequence[Mapping], tokenizer, prompt_format: str,
             max_len: int, pad_to: int = 16) -> Batch:
    """One SFT batch: rows = prompt + demonstration + EOS, right padded to the longest row rounded
    up to a multiple of `pad_to` (at most `max_len`: a few shapes, so few compilations); the loss
    mask covers the demonstration and EOS tokens."""
    rows = []
    for rec in records:
        p = task.render(rec, tokenizer, prompt_format)
        d = task.render_demonstration(rec, tokenizer, prompt_format)
        if len(p) + len(d) > max_len:
            raise ValueError(f"SFT row of {len(p) + len(d)} tokens (prompt {len(p)} + "
                             f"demonstration {len(d)}) for record {rec.get('uid')!r} exceeds "
                             f"data.sft.max_len={max_len}")
        rows.append((p, d))
    b = len(rows)
    t = min(max_len, round_up(max(len(p) + len(d) for p, d in rows), pad_to))
    tokens = np.full((b, t), tokenizer.pad_id, np.int32)
    mask = np.zeros((b, t), np.float32)
    seg = np.zeros((b, t), np.int32)
    for i, (p, d) in enumerate(rows):
        n = len(p) + len(d)
        tokens[i, :n] = p + d
        mask[i, len(p):n] = 1.0
        seg[i, :n] = 1
    positions = np.broadcast_to(np.arange(t, dtype=np.int32), (b, t)).copy()
    return Batch(tokens=tokens, positions=positions, segment_ids=seg, loss_mask=mask,
                 rewards=np.zeros((b,), np.float32), group_ids=np.arange(b, dtype=np.int32))


def run_sft(model_cfg: ModelConfig, data_cfg: DataConfig, *, mesh: Mesh, tokenizer,
            task: Task | None = None, params: dict | None = None,
            on_log: Callable[[int, dict], None] | None = None) -> tuple[dict, dict]:
    """`data_cfg.sft.steps` supervised steps from `params` (default: random init).

    Returns (params, info) with info = {"losses": [(step, loss), ...], "wall_s": ...}."""
    sft = data_cfg.sft
    task = task or build_task(data_cfg)
    fmt = resolve_format(tokenizer, data_cfg.prompt_format)
    train_cfg = sft_train_config(sft)
    graphdef, _ = model_graphdef(model_cfg, train_cfg)
    _, shardings = train_state_shardings(model_cfg, train_cfg, mesh)
    state = init_train_state(model_cfg, train_cfg, mesh, params=params)
    it = PromptIterator(task.source("train"), prompts_per_step=sft.batch_size, seed=sft.seed,
                        epochs=0)
    # the trainer's own jitted step (non-finite guard included) with the "sft" objective
    step_fn = make_train_step(graphdef, train_cfg, mesh, shardings, objective="sft")
    losses, t0, pending = [], time.perf_counter(), None
    # the one console display of SFT (process 0); `on_log` receives the same rows as data
    bar = Progress("SFT", sft.steps, unit="step", enabled=jax.process_index() == 0,
                   announce=True)
    for step in range(1, sft.steps + 1):
        batch = sft_rows(task, next(it), tokenizer, fmt, sft.max_len)
        state, metrics = step_fn(state, batch)
        if pending is not None:  # read the previous step's metrics: no host sync per step
            _record(pending, losses, sft.log_every, on_log, sft.steps, bar)
        pending = (step, metrics)
    if pending is not None:
        _record(pending, losses, sft.log_every, on_log, sft.steps, bar)
    bar.close()
    params = jax.block_until_ready(state.params)
    return params, {"losses": losses, "wall_s": time.perf_counter() - t0, "steps": sft.steps}


def _record(pending, losses, every, on_log, last, bar):
    step, metrics = pending
    if step % every == 0 or step == 1 or step == last:
        host = jax.device_get(metrics)
        m = {"sft/loss": float(host["loss/total"]), "sft/grad_norm": float(host["train/grad_norm"])}
        if not np.isfinite(m["sft/loss"]) or host["train/nonfinite"]:
            raise FloatingPointError(f"SFT loss is {m['sft/loss']} at step {step}; lower "
                                     "data.sft.lr")
        losses.append((step, m["sft/loss"]))
        bar.update(step - bar.done, step=step, loss=round(m["sft/loss"], 4))
        if on_log:
            on_log(step, m)


# --- cache ----------------------------------------------------------------------------------------


def _files_stamp(patterns: Sequence[str]) -> list:
    from jaxrl.data.sources import expand_paths

    if not patterns:
        return []
    return [(str(p.resolve()), p.stat().st_size, int(p.stat().st_mtime)) for p in
            expand_paths(patterns)]


def cache_key(model_cfg: ModelConfig, data_cfg: DataConfig, tokenizer) -> str:
    """Hash of everything that determines the warm-started parameters."""
    data = {k: v for k, v in to_dict(data_cfg).items() if k not in _NOT_IN_KEY}
    data["sft"] = {k: v for k, v in data["sft"].items() if k not in _SFT_NOT_IN_KEY}
    payload = {
        "model": to_dict(model_cfg), "data": data,
        "files": _files_stamp(data_cfg.paths) + _files_stamp(data_cfg.eval_paths),
        "tokenizer": [type(tokenizer).__name__, tokenizer.vocab_size,
                      getattr(tokenizer, "chat_template", None)],
        "format": resolve_format(tokenizer, data_cfg.prompt_format),
        "version": 1,
    }
    text = json.dumps(payload, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


@functools.cache
def code_stamp() -> str:
    """Hash of the code that shapes a warm start (jaxrl's models, trainer, data and tokenizer
    sources, and the jax version). Kept in a cache entry's meta.json: not part of the key, so
    that editing the code never throws away a long SFT run, but a hit from other code warns."""
    root = Path(__file__).resolve().parents[1]
    files = [root / "tokenizers.py"]
    for sub in ("models", "train", "data"):
        files += sorted((root / sub).rglob("*.py"))
    h = hashlib.sha256(jax.__version__.encode())
    for f in files:
        h.update(str(f.relative_to(root)).encode())
        h.update(f.read_bytes())
    return h.hexdigest()[:16]


def _abstract_params(model_cfg: ModelConfig, mesh: Mesh, sft) -> dict:
    abstract, _ = train_state_shardings(model_cfg, sft_train_config(sft), mesh)
    return abstract.params


def _save_params(params: dict, path: Path) -> None:
    import orbax.checkpoint as ocp

    ckptr = ocp.StandardCheckpointer()
    ckptr.save(path.absolute(), params)
    ckptr.wait_until_finished()
    ckptr.close()


def load_cached(path: str | Path, model_cfg: ModelConfig, mesh: Mesh, sft) -> dict:
    """Parameters of a complete cache entry, read into the trainer-mesh shardings."""
    import orbax.checkpoint as ocp

    path = Path(path)
    ckptr = ocp.StandardCheckpointer()
    try:
        return ckptr.restore((path / "params").absolute(), _abstract_params(model_cfg, mesh, sft))
    finally:
        ckptr.close()


def warm_start(model_cfg: ModelConfig, data_cfg: DataConfig, *, mesh: Mesh, tokenizer,
               task: Task | None = None, cache_dir: str | Path | None = None,
               on_log: Callable[[int, dict], None] | None = None) -> tuple[dict | None, dict]:
    """SFT-warm-started params (None when `data_cfg.sft.steps == 0`), trained once per cache key.

    Returns (params, info): info has "cache_hit", "cache_path", "losses", "wall_s"."""
    sft = data_cfg.sft
    if sft.steps == 0:
        return None, {"cache_hit": False, "cache_path": None, "losses": [], "wall_s": 0.0}
    key = cache_key(model_cfg, data_cfg, tokenizer)
    root = Path(cache_dir if cache_dir is not None else sft.cache_dir)
    final = root / f"sft-{key}"
    if sft.cache and (final / "meta.json").is_file():
        meta = json.loads((final / "meta.json").read_text())
        params = load_cached(final, model_cfg, mesh, sft)
        log.info("SFT warm start: cache hit %s", final)
        if meta.get("code") != code_stamp():
            log.warning(
                "SFT warm start %s was made by other jaxrl code or another jax version than this "
                "run's (the key covers the settings, not the code), so it may differ from what "
                "this code would train; delete that directory, or pass --data.sft.cache=false, "
                "to train it again", final)
        return params, {**meta, "cache_hit": True, "cache_path": str(final)}
    params, info = run_sft(model_cfg, data_cfg, mesh=mesh, tokenizer=tokenizer, task=task,
                           on_log=on_log)
    info = {**info, "key": key, "model": to_dict(model_cfg), "data": to_dict(data_cfg),
            "code": code_stamp()}
    if sft.cache:
        _write_atomic(final, params, info)
    return params, {**info, "cache_hit": False, "cache_path": str(final) if sft.cache else None}


def _write_atomic(final: Path, params: dict, info: dict) -> None:
    """Write params + meta.json under a temporary name, then rename into place."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{time.time_ns()}"
    try:
        _save_params(params, tmp / "params")
        (tmp / "meta.json").write_text(json.dumps(info, indent=1, default=str))
        try:
            os.rename(tmp, final)
        except OSError:  # another process finished the same key first: keep theirs
            if not (final / "meta.json").is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def sft_model(model_cfg: ModelConfig, params: dict):
    """An NNX `Transformer` bound to `params` (for generation / evaluation)."""
    graphdef, _ = model_graphdef(model_cfg, TrainConfig())
    return nnx.merge(graphdef, params)

