"""`sample(model, prompts, SamplingParams(...)) -> list[Completion]`: generation in one call."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from jax.sharding import Mesh

from jaxrl.data.tasks import encode_prompt
from jaxrl.generate.engine import MIN_BUCKET, JaxEngine
from jaxrl.generate.sampling import SamplingParams
from jaxrl.generate.scheduler import Completion, Scheduler
from jaxrl.models.hf import load_pretrained
from jaxrl.models.transformer import Transformer
from jaxrl.rounding import next_power_of_two, round_up
from jaxrl.tokenizers import load_tokenizer


def _as_model(model_or_params, mesh: Mesh | None) -> Transformer:
    if isinstance(model_or_params, Transformer):
        return model_or_params
    if isinstance(model_or_params, tuple) and len(model_or_params) == 2:
        if isinstance(model_or_params[1], Transformer):  # (cfg, model) from load_pretrained
            return model_or_params[1]
    if isinstance(model_or_params, str | Path):
        return load_pretrained(model_or_params, mesh=mesh, role="generator")[1]
    raise TypeError("sample: expected a Transformer, a (config, Transformer) pair or a checkpoint "
                    f"path, got {type(model_or_params).__name__}")


def sample(model_or_params, prompts: str | Sequence[str] | Sequence[Sequence[int]],
           sampling: SamplingParams, *, num_slots: int | None = None, max_len: int | None = None,
           mesh: Mesh | None = None, eos_ids: Sequence[int] = (), chunk_steps: int = 16,
           tokenizer=None, chat: bool = False) -> list[Completion]:
    """Sample `sampling.n` completions for each prompt.

    `model_or_params` is a `Transformer`, a `(config, Transformer)` pair, a checkpoint path, or a
    `JaxEngine` (reused as is: its compiled functions, slots, cache length and EOS ids).

    `prompts` are token-id lists, or text (one string or a list of strings) encoded with
    `tokenizer` (`jaxrl.tokenizers`; by default the checkpoint's own when `model_or_params` is a
    path). With `chat=True` each text prompt is one user message rendered with the tokenizer's
    chat template, then encoded. With a tokenizer and no `eos_ids`, its EOS ids stop generation
    (`eos_ids`: the tokenizer's and its generation_config.json's).

    Returns `len(prompts) * n` completions ordered by prompt, then sample index. The KV cache is
    sized to the longest prompt + `max_tokens` (rounded up to a power of two) unless `max_len`
    is given; `num_slots` defaults to the number of samples, at most 64.
    """
    if isinstance(prompts, str):
        prompts = [prompts]
    if any(isinstance(p, str) for p in prompts):
        if tokenizer is None and isinstance(model_or_params, str | Path):
            tokenizer = load_tokenizer(model_or_params)
        prompts = encode_prompts(prompts, tokenizer, chat=chat)
        eos_ids = eos_ids or tokenizer.eos_ids
    elif chat:
        raise TypeError("sample: chat=True takes text prompts (the template renders text)")
    if not all(isinstance(p, Sequence) and not isinstance(p, str) for p in prompts):
        raise TypeError("sample: prompts must be text (str, list[str]) or token-id lists "
                        "(list[list[int]])")
    if not prompts:
        return []
    if isinstance(model_or_params, JaxEngine):  # reuse its compiled functions
        engine = model_or_params
    else:
        engine = _engine_for(_as_model(model_or_params, mesh), prompts, sampling, num_slots,
                             max_len, mesh, eos_ids, chunk_steps)
    scheduler = Scheduler(engine)
    ids = [scheduler.submit(p, sampling) for p in prompts]
    order = {rid: i for i, rid in enumerate(ids)}
    done = scheduler.run()
    return sorted(done, key=lambda c: (order[c.request_id], c.sample_index))


def encode_prompts(prompts: Sequence[str], tokenizer, *, chat: bool = False) -> list[list[int]]:
    """Token ids of text prompts; with `chat`, each one a user message through the tokenizer's
    chat template. BOS first exactly once when the tokenizer adds one, as a run renders them
    (`jaxrl.data.tasks.encode_prompt`)."""
    if tokenizer is None:
        raise TypeError("sample: text prompts need a tokenizer (tokenizer=load_tokenizer(...)), "
                        "or pass token-id lists")
    if not all(isinstance(p, str) for p in prompts):
        raise TypeError("sample: prompts mix text and token ids; pass one kind")
    if not chat:
        return [encode_prompt(tokenizer, p) for p in prompts]
    if not hasattr(tokenizer, "apply_chat_template"):
        raise TypeError(f"sample: chat=True needs a tokenizer with a chat template; "
                        f"{type(tokenizer).__name__} has none")
    return [encode_prompt(tokenizer, [{"role": "user", "content": p}]) for p in prompts]


def _engine_for(model, prompts, sampling, num_slots, max_len, mesh, eos_ids, chunk_steps):
    if max_len is None:
        longest = max(len(p) for p in prompts) + sampling.max_tokens
        max_len = next_power_of_two(longest, minimum=MIN_BUCKET)
    total = len(prompts) * sampling.n
    num_slots = num_slots or min(total, 64)
    if mesh is not None:  # slots split evenly over the data-parallel replicas
        dp = mesh.shape["dp"]
        num_slots = round_up(num_slots, dp)
    return JaxEngine(model, num_slots=num_slots, max_len=max_len, mesh=mesh,
                     chunk_steps=chunk_steps, eos_ids=eos_ids)
