"""The train step's memory: the activations its backward pass keeps (analytic), and the step
compiled for the plan's largest update (whose `memory_analysis()` measures it), for `plan.py`.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp

from jaxrl.config import ModelConfig, RunConfig
from jaxrl.models.attention import query_blocks
from jaxrl.train.batch import Batch, padded_shape
from jaxrl.train.logprobs import chunk_size
from jaxrl.train.objective import correction_needs
from jaxrl.train.state import (
    frozen_shardings,
    make_optimizer,
    model_graphdef,
    train_state_shardings,
)
from jaxrl.train.step import batch_shardings, train_step

GiB, MiB = 2**30, 2**20
BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}


def fmt_bytes(n: float) -> str:
    return f"{n / GiB:.2f} GiB" if abs(n) >= GiB else f"{n / MiB:.1f} MiB"


def _split(n: int, ways: int) -> int:
    return n // ways if n % ways == 0 else n  # the table replicates a dim that does not divide


def activation_bytes(m: ModelConfig, *, rows: int, length: int, chunk: int, remat: str,
                     flash: bool, keep_probs: bool, tp: int = 1) -> int:
    """Bytes one device keeps for the backward pass of a micro-batch of `rows` x `length`, plus
    the largest transient (one layer's cotangents, one lm-head chunk). Per token and layer, with c
    the compute dtype's bytes: RMSNorms 2 E (4 + c), residual stream 2 E c, q k v after RoPE and
    k before (H + 3K) D c, attention output H D c, SwiGLU gate and up 2 F c; with XLA attention
    (no flash kernel) the kept scores: per query block, H x block x keys x (3 f32 + mask + probs
    in c); k / v slices per block. Once per token: embedding E c, final norm E (4 + c), RoPE D 4,
    loss terms 64, the lm-head softmax V 4 when kept. remat "full" keeps each layer's input E c;
    "dots" the matmul outputs (scores in f32 too); "dots_no_batch" those without batch dims."""
    c = BYTES[m.dtype]
    e, d, f = m.hidden_size, m.head_size, _split(m.intermediate_size, tp)
    h, k = _split(m.num_heads, tp), _split(m.num_kv_heads, tp)
    v = _split(m.vocab_size, tp)
    blocks = query_blocks(length)
    area = sum((b - a) * b for a, b in blocks) / length  # score columns per query (XLA)
    if flash:
        scores, scores_f32, slices = h * 4, 0, 0  # the kernel keeps a log-sum-exp per head
    else:
        scores, scores_f32 = h * area * (12 + 1 + (c if c != 4 else 0)), h * area * 4
        slices = 2 * k * d * c * sum(b for _, b in blocks) / length
    layer = (2 * e * (4 + c) + 2 * e * c + (h + 3 * k) * d * c + h * d * c + 2 * f * c
             + scores + slices)
    dots = (h + 2 * k) * d * c + 2 * e * c + 2 * f * c
    saved = {"none": layer, "full": e * c, "dots": dots + h * d * c + scores_f32,
             "dots_no_batch": dots}[remat]
    once = e * c + e * (4 + c) + d * 4 + 64 + (v * 4 if keep_probs else 8)
    # + one layer live in the backward (its cotangents; recomputed under remat), + the lm head's
    # f32 [rows, chunk, V] arrays: ~3 live with the softmax kept, ~5 when the backward recomputes
    # it (fitted to the compiled step's memory analysis on CPU, docs/memory.md)
    live = rows * length * (m.num_layers * saved + once + layer)
    return int(live + (3 if keep_probs else 5) * rows * min(chunk, length) * v * 4)


def update_shape(cfg: RunConfig, fsdp: int, max_seq_len: int) -> tuple[int, int]:
    """[rows, T] of the largest update's batch: one mini-batch of whole groups, padded as the
    trainer pads it (`Trainer.pad`)."""
    groups = -(-cfg.data.prompts_per_step // cfg.train.mini_batches)
    return padded_shape(groups * cfg.data.group_size, max_seq_len,
                        row_multiple=cfg.train.micro_batches * fsdp,
                        min_len=min(cfg.train.logprob_chunk, 16))


def compile_train_step(cfg: RunConfig, model_cfg: ModelConfig, mesh, *, max_seq_len: int):
    """The train step compiled for the plan's largest update on `mesh` (what `Trainer` would
    run; `step.make_train_step` jits the same function), for `plan_memory(compiled=...)`."""
    t = cfg.train
    pdt, cdt = t.precision(model_cfg.param_dtype, model_cfg.dtype, mesh.devices.flat[0].platform)
    m = dataclasses.replace(model_cfg, param_dtype=pdt, dtype=cdt)
    rows, length = update_shape(cfg, mesh.shape["fsdp"], max_seq_len)
    bt = lambda dt: jax.ShapeDtypeStruct((rows, length), dt)  # noqa: E731
    b = lambda dt: jax.ShapeDtypeStruct((rows,), dt)  # noqa: E731
    needs = correction_needs(t)
    opt = {"behaviour_logprobs": "behaviour" in needs, "ref_logprobs": t.needs_reference,
           "proximal_logprobs": "proximal" in needs or t.mini_batches * t.epochs > 1}
    batch = Batch(tokens=bt(jnp.int32), positions=bt(jnp.int32), segment_ids=bt(jnp.int32),
                  loss_mask=bt(jnp.float32), rewards=b(jnp.float32), group_ids=b(jnp.int32),
                  **{k: bt(jnp.float32) if v else None for k, v in opt.items()})
    abstract, shardings = train_state_shardings(m, t, mesh)
    graphdef, _ = model_graphdef(m, t)
    step = functools.partial(train_step, graphdef=graphdef, cfg=t, tx=make_optimizer(t))
    frozen, frozen_sh = frozen_shardings(m, t, mesh)  # LoRA: the base beside the state
    fn = jax.jit(step, in_shardings=(shardings, batch_shardings(batch, mesh), frozen_sh),
                 out_shardings=(shardings, None), donate_argnums=0)
    with jax.set_mesh(mesh):
        return fn.lower(abstract, batch, frozen).compile()


def train_step_activations(cfg: RunConfig, model_cfg: ModelConfig, trainer_shape,
                           max_seq_len: int, platform: str):
    """(bytes per device, (rows, micro-batch rows, T), flash attention?, remat planned) for the
    largest update; `model_cfg` with the trainer's resolved dtypes."""
    t, (fsdp, tp) = cfg.train, trainer_shape
    rows, length = update_shape(cfg, fsdp, max_seq_len)
    micro = rows // t.micro_batches
    keep = micro * length * model_cfg.vocab_size * 4 <= t.lm_head_keep_mb * MiB
    # the train step passes segment ids: "cudnn" then runs the XLA path (`models.attention`)
    flash = (model_cfg.attention_impl == "pallas"
             or (model_cfg.attention_impl == "auto" and platform != "cpu"))
    # "full" recomputes each layer after its cotangent arrives (jaxrl.models.remat) on every
    # backend; the policy variants use nnx.remat, whose recomputation XLA:CPU merges back into
    # the forward pass (no memory saved, measured: docs/memory.md), so on CPU they plan as "none"
    remat = "none" if platform == "cpu" and t.remat != "full" else t.remat
    act = activation_bytes(model_cfg, rows=micro // fsdp, length=length,
                           chunk=chunk_size(length, t.logprob_chunk), remat=remat,
                           flash=flash, keep_probs=keep, tp=tp)
    return act, (rows, micro, length), flash, remat
