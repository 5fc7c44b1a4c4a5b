"""`python launch/bench.py train [--vs torch]`: train_step tokens/s and MFU on a ~40M model.

The model is Qwen2-shaped (hidden 512, 8 layers, 8 heads, 2 kv heads, vocab 32000, mlp 1408,
tied embeddings), f32, one sequence length and global batch (default 512 x 16), trained with the
default GRPO objective (ppo_clip, token_mean) and AdamW. MFU = model FLOPs (6 N + attention, see
`jaxrl.train.flops`) / (step time x peak FLOP/s of the backend; a measured matmul peak on CPU).
`--model tiny` times the ~0.8M synthetic-task model instead (quick runs: `bench.py suite` smoke).

With `--vs torch`, the same shapes as a `transformers.Qwen2ForCausalLM` trained with
`torch.optim.AdamW` on the same batch (on-policy policy-gradient loss, whose gradient equals the
GRPO ppo_clip gradient at ratio 1) are timed in the same run, and the ratio printed.

The torch peer runs with OMP_WAIT_POLICY=PASSIVE unless set (see `make_torch_step`).
Shared machines are noisy, so each timed iteration runs one jax step, one torch step and one
f32 matmul probe back to back; figures are medians, the ratio is the median of per-iteration
ratios, and MFU is given both against the machine's cached peak (`train/mfu`) and against the
matmul rate probed in the same iteration (what the cores delivered at that moment).

With `--moe`, a Qwen3-MoE of the same attention and embedding (8 experts of 192, top-2: 40.5M
parameters, 26.3M active) and the dense Qwen3 of its active shape (MLP 384 = 2 x 192) are timed
interleaved in one run; MFU counts active parameters (`jaxrl.train.flops`), so the two MFUs say
what the dropless `ragged_dot` experts cost over a dense MLP of the same FLOPs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import time

import numpy as np

from jaxrl.benchmarks import missing_packages
from jaxrl.config import LoraConfig, MeshConfig, ModelConfig
from jaxrl.presets import tiny_task_model_config
from jaxrl.train.config import TrainConfig
from jaxrl.train.flops import peak_flops, train_flops_per_token


def bench_model_config(args):
    return ModelConfig(
        architecture="qwen2",
        vocab_size=32000,
        hidden_size=512,
        intermediate_size=1408,
        num_layers=8,
        num_heads=8,
        num_kv_heads=2,
        qkv_bias=True,
        tie_embeddings=True,
        max_position_embeddings=max(args.seq, 512),
        attention_impl="auto",
        # bf16-mixed: the trainer's precision setting (bf16 compute, f32 master weights) rather
        # than the model config's
        dtype="float32" if args.dtype == "bf16-mixed" else args.dtype,
        param_dtype="float32",
    )


def qwen2_0_5b_model_config(args):
    """Qwen2.5-0.5B's shape (0.49B parameters; configs/qwen2_5_0_5b_gsm8k.py), random weights:
    the accelerator check's model (launch/device_check.py)."""
    return dataclasses.replace(
        bench_model_config(args), vocab_size=151936, hidden_size=896, intermediate_size=4864,
        num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0,
        rms_norm_eps=1e-6, max_position_embeddings=max(args.seq, 2048))


def moe_model_configs(args):
    """(the ~40M-total MoE, the dense model of its active shape): Qwen3 attention (q/k norm, no
    bias) on the benchmark's hidden 512 / 8 layers / vocab 32000; 8 experts of 192, top-2,
    renormalised; the dense MLP 384 wide."""
    base = dataclasses.replace(bench_model_config(args), architecture="qwen3", qkv_bias=False,
                               qk_norm=True, intermediate_size=384)
    moe = dataclasses.replace(base, architecture="qwen3_moe", num_experts=8,
                              experts_per_token=2, moe_intermediate_size=192,
                              norm_topk_prob=True)
    return moe, base


def make_inputs(args, vocab: int):
    rng = np.random.default_rng(0)
    b, t = args.batch, args.seq
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 4 :] = 1.0  # a quarter prompt, three quarters completion
    rewards = rng.integers(0, 2, b).astype(np.float32)
    g = 4 if b % 4 == 0 else b  # groups of 4 samples per prompt
    groups = np.repeat(np.arange(b // g), g).astype(np.int32)
    return tokens, mask, rewards, groups


def make_jax_step(args, model_cfg, inputs, *, lora_rank: int = 0, memory: dict | None = None):
    """`step()` of a jaxrl Trainer on `inputs`; with `lora_rank`, rank-r adapters on every
    projection (the base frozen). `memory` gets the state's bytes and the compiled step's
    memory analysis."""
    import jax

    from jaxrl.sharding import make_meshes
    from jaxrl.train.batch import make_batch
    from jaxrl.train.trainer import Trainer

    n = len(jax.devices())
    mesh = make_meshes(MeshConfig(trainer=(n, 1), generator=(n, 1), colocated=True)).trainer
    cfg = TrainConfig(
        lr=1e-5, micro_batches=args.micro_batches, remat=args.remat, logprob_chunk=args.chunk,
        compute_dtype="bfloat16" if args.dtype == "bf16-mixed" else "auto",
        param_dtype="float32",
    )
    if lora_rank:
        model_cfg = dataclasses.replace(model_cfg, lora=LoraConfig(rank=lora_rank,
                                                                   alpha=2.0 * lora_rank))
    trainer = Trainer(model_cfg, cfg, mesh)
    batch = make_batch(*inputs)
    if memory is not None:
        memory.update(step_memory(trainer, batch))

    def step():  # dispatch + block: the full host-visible cost of one update
        trainer.step(batch)

    return step


def step_memory(trainer, batch) -> dict:
    """Bytes of the trainer's state (params + optimiser, and a LoRA base) and the compiled
    train step's `memory_analysis()` temporaries, for this batch's padded shape."""
    import jax

    from jaxrl.train.state import make_optimizer
    from jaxrl.train.step import batch_shardings, train_step
    from jaxrl.train.trainer import tree_bytes

    padded = trainer.pad(batch)
    frozen_sh = (None if trainer.frozen is None
                 else jax.tree.map(lambda x: x.sharding, trainer.frozen))
    fn = jax.jit(functools.partial(train_step, graphdef=trainer.graphdef, cfg=trainer.cfg,
                                   tx=make_optimizer(trainer.cfg)),
                 in_shardings=(trainer.shardings, batch_shardings(padded, trainer.mesh),
                               frozen_sh),
                 out_shardings=(trainer.shardings, None), donate_argnums=0)
    with jax.set_mesh(trainer.mesh):
        ma = fn.lower(trainer.abstract_state, padded, trainer.frozen).compile().memory_analysis()
    return {"trained_params_bytes": tree_bytes(trainer.state.params),
            "opt_state_bytes": tree_bytes(trainer.state.opt_state),
            "frozen_base_bytes": tree_bytes(trainer.frozen) if trainer.frozen else 0,
            "step_temp_bytes": int(ma.temp_size_in_bytes)}


def torch_peer_model(model_cfg):
    """The `transformers` model (f32, random weights) of the same shapes as `model_cfg`, its
    config written by `config_to_hf`, the mapping jaxrl's checkpoints are saved with."""
    import transformers

    from jaxrl.models.hf import config_to_hf

    hf_cfg = transformers.AutoConfig.for_model(**config_to_hf(model_cfg))
    return transformers.AutoModelForCausalLM.from_config(hf_cfg).float()


def make_torch_step(args, model_cfg, inputs):
    # OpenMP's default busy-wait collapses when other processes share the cores (measured 4x
    # slower on a loaded 2-core box); passive waiting is torch's best setting there. It must be
    # set before torch starts its thread pool; an explicit OMP_WAIT_POLICY wins.
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.torch_threads)
    torch.manual_seed(0)
    model = torch_peer_model(model_cfg).train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    tokens, mask, rewards, groups = (torch.as_tensor(x) for x in inputs)
    r = rewards.view(-1, int((groups == 0).sum()))
    adv = ((r - r.mean(1, keepdim=True)) / (r.std(1, keepdim=True) + 1e-6)).view(-1)
    tgt_mask = mask[:, 1:]

    def step():
        opt.zero_grad(set_to_none=True)
        logits = model(input_ids=tokens.long()).logits[:, :-1].float()
        logp = torch.log_softmax(logits, -1).gather(-1, tokens[:, 1:, None].long())[..., 0]
        loss = -(adv[:, None] * logp * tgt_mask).sum() / tgt_mask.sum()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()

    return step


def make_matmul_probe(n: int = 2048):
    import jax
    import jax.numpy as jnp

    a = jnp.ones((n, n), jnp.float32)
    f = jax.jit(lambda x, y: jnp.dot(x, y, precision="highest"))
    f(a, a).block_until_ready()

    def probe() -> float:
        t0 = time.perf_counter()
        f(a, a).block_until_ready()
        return 2.0 * n**3 / (time.perf_counter() - t0)

    return probe


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main(argv: list[str]) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.moe and (args.vs != "none" or args.lora_rank or args.model != "bench"):
        p.error("--moe runs alone (no --vs torch, no --lora-rank, no --model tiny)")
    if args.lora_rank < 0:
        p.error(f"--lora-rank must be >= 0, got {args.lora_rank}")
    if args.vs == "torch" and (why := missing_packages("--vs torch")):
        p.error(why)
    print(json.dumps(run(args)))
    return 0


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="bench.py train", description=__doc__.splitlines()[0])
    p.add_argument("--vs", choices=["torch", "none"], default="none")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=3, help="timed iterations")
    p.add_argument("--warmup", type=int, default=1)
    p.add_argument("--micro-batches", type=int, default=4, help="gradient accumulation")
    p.add_argument("--remat", default="none")
    p.add_argument("--chunk", type=int, default=128, help="logprob chunk (tokens)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "bf16-mixed"],
                   help="compute dtype (master weights f32); bf16-mixed sets it through "
                        "train.compute_dtype; the torch peer runs in float32")
    p.add_argument("--torch-threads", type=int, default=2)
    p.add_argument("--model", choices=["bench", "tiny", "qwen2-0.5b"], default="bench",
                   help="tiny: the ~0.8M synthetic-task model (quick runs, e.g. the suite's "
                        "smoke size); qwen2-0.5b: Qwen2.5-0.5B's shape (for accelerators)")
    p.add_argument("--lora-rank", type=int, default=0,
                   help="also time a LoRA trainer (adapters of this rank on every projection, "
                        "alpha 2 x rank) interleaved with the full-parameter one, and compare "
                        "their memory (state bytes, compiled step temporaries)")
    p.add_argument("--moe", action="store_true",
                   help="a ~40M-total Qwen3-MoE (8 experts, top-2) against the dense Qwen3 of "
                        "its active shape, interleaved (the jax row is the dense model)")
    return p


def run(args) -> dict:
    """The figures of one run (`args` from `main`'s parser); prints the text report as it goes."""
    peak = peak_flops(refresh=True)  # measure now; the cache keeps the best seen on this machine
    model_cfg = bench_model_config(args)
    if args.model == "tiny":
        model_cfg = tiny_task_model_config(max_position_embeddings=max(args.seq, 256),
                                           dtype=model_cfg.dtype)
    elif args.model == "qwen2-0.5b":
        model_cfg = qwen2_0_5b_model_config(args)
    moe_cfg = None
    if args.moe:
        moe_cfg, model_cfg = moe_model_configs(args)
    inputs = make_inputs(args, model_cfg.vocab_size)
    tokens = args.batch * args.seq
    flops = train_flops_per_token(model_cfg, args.seq) * tokens
    memory = {"full": {}, "lora": {}}
    # the memory analysis compiles the step once more: only for the LoRA comparison that uses it
    jax_step = make_jax_step(args, model_cfg, inputs,
                             memory=memory["full"] if args.lora_rank else None)
    lora_step = (make_jax_step(args, model_cfg, inputs, lora_rank=args.lora_rank,
                               memory=memory["lora"]) if args.lora_rank else None)
    torch_step = make_torch_step(args, model_cfg, inputs) if args.vs == "torch" else None
    moe_step = make_jax_step(args, moe_cfg, inputs) if moe_cfg is not None else None
    probe = make_matmul_probe()
    rows = []
    for i in range(args.warmup + args.steps):
        row = {"jax_s": _timed(jax_step)}
        if lora_step is not None:
            row["lora_s"] = _timed(lora_step)
        if torch_step is not None:
            row["torch_s"] = _timed(torch_step)
        if moe_step is not None:
            row["moe_s"] = _timed(moe_step)
        row["matmul_flops"] = max(probe(), probe())
        tag = "warmup" if i < args.warmup else "timed"
        print(f"[{tag} {i}] " + "  ".join(f"{k}={v:.4g}" for k, v in row.items()), flush=True)
        if i >= args.warmup:
            rows.append(row)
    med = lambda key: statistics.median(r[key] for r in rows)
    jax_s = med("jax_s")
    out = {
        "model_params": model_cfg.num_params(),
        "batch": args.batch,
        "seq": args.seq,
        "micro_batches": args.micro_batches,
        "flops_per_token": train_flops_per_token(model_cfg, args.seq),
        "peak_flops_cached": peak,
        "matmul_flops_probed": med("matmul_flops"),
        "jax_step_s": jax_s,
        "jax_tokens_per_s": tokens / jax_s,
        "jax_mfu": flops / jax_s / peak,
        "jax_mfu_vs_probe": statistics.median(flops / r["jax_s"] / r["matmul_flops"] for r in rows),
    }
    print(
        f"jax   : {tokens / jax_s:9.1f} tokens/s  step {jax_s:.2f}s  MFU {out['jax_mfu']:.1%} of "
        f"cached peak {peak / 1e9:.1f} GFLOP/s, {out['jax_mfu_vs_probe']:.1%} of the probed "
        f"matmul rate ({out['matmul_flops_probed'] / 1e9:.1f} GFLOP/s)",
        flush=True,
    )
    if lora_step is not None:
        lora_s = med("lora_s")
        out.update(lora_rank=args.lora_rank, lora_step_s=lora_s, memory=memory,
                   lora_speedup=statistics.median(r["jax_s"] / r["lora_s"] for r in rows))
        state = lambda m: m["trained_params_bytes"] + m["opt_state_bytes"] + m[  # noqa: E731
            "frozen_base_bytes"]
        mib = lambda b: f"{b / 2**20:.1f} MiB"  # noqa: E731
        print(f"lora  : rank {args.lora_rank}  step {lora_s:.2f}s  "
              f"({out['lora_speedup']:.2f}x the full-parameter step, median of paired ratios)")
        for name, m in memory.items():
            print(f"  {name:4s}: state {mib(state(m))} (trained params "
                  f"{mib(m['trained_params_bytes'])}, optimizer {mib(m['opt_state_bytes'])}, "
                  f"frozen base {mib(m['frozen_base_bytes'])}), compiled step temporaries "
                  f"{mib(m['step_temp_bytes'])}")
    if moe_step is not None:
        _report_moe(out, rows, moe_cfg, model_cfg, tokens, peak)
    if torch_step is not None:
        t_s = med("torch_s")
        out.update(
            torch_step_s=t_s,
            torch_tokens_per_s=tokens / t_s,
            torch_mfu=flops / t_s / peak,
            torch_mfu_vs_probe=statistics.median(
                flops / r["torch_s"] / r["matmul_flops"] for r in rows
            ),
            ratio_vs_torch=statistics.median(r["torch_s"] / r["jax_s"] for r in rows),
        )
        print(
            f"torch : {tokens / t_s:9.1f} tokens/s  step {t_s:.2f}s  MFU {out['torch_mfu']:.1%} "
            f"of cached peak, {out['torch_mfu_vs_probe']:.1%} of the probed matmul rate"
        )
        print(f"jax / torch tokens/s (median of paired ratios): {out['ratio_vs_torch']:.2f}x")
    return out


def _report_moe(out: dict, rows: list[dict], moe_cfg, dense_cfg, tokens: int, peak: float):
    seq = out["seq"]
    flops = train_flops_per_token(moe_cfg, seq) * tokens
    moe_s = statistics.median(r["moe_s"] for r in rows)
    out.update(
        moe_params=moe_cfg.num_params(), moe_active_params=moe_cfg.num_params(active=True),
        dense_params=dense_cfg.num_params(), moe_flops_per_token=train_flops_per_token(
            moe_cfg, seq),
        moe_step_s=moe_s, moe_tokens_per_s=tokens / moe_s, moe_mfu=flops / moe_s / peak,
        moe_mfu_vs_probe=statistics.median(flops / r["moe_s"] / r["matmul_flops"]
                                           for r in rows),
        moe_over_dense_step=statistics.median(r["moe_s"] / r["jax_s"] for r in rows),
    )
    print(f"moe   : {tokens / moe_s:9.1f} tokens/s  step {moe_s:.2f}s  MFU (active params) "
          f"{out['moe_mfu']:.1%} of cached peak, {out['moe_mfu_vs_probe']:.1%} of the probed "
          f"matmul rate; {out['moe_params'] / 1e6:.1f}M params, "
          f"{out['moe_active_params'] / 1e6:.1f}M active (dense peer "
          f"{out['dense_params'] / 1e6:.1f}M)")
    print(f"moe / dense step time (median of paired ratios): {out['moe_over_dense_step']:.2f}x")
