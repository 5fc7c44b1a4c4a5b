"""`python launch/bench.py train [--vs torch]`: train_step tokens/s and MFU on a ~40M model.

The model is Qwen2-shaped (hidden 512, 8 layers, 8 heads, 2 kv heads, vocab 32000, mlp 1408,
tied embeddings), f32, one sequence length and global batch (default 512 x 16), trained with the
default GRPO objective (ppo_clip, token_mean) and AdamW. MFU = model FLOPs (6 N + attention, see
`jaxrl.train.flops`) / (step time x peak FLOP/s of the backend; a measured matmul peak on CPU).

With `--vs torch`, the same shapes as a `transformers.Qwen2ForCausalLM` trained with
`torch.optim.AdamW` on the same batch (on-policy policy-gradient loss, whose gradient equals the
GRPO ppo_clip gradient at ratio 1) are timed in the same run, and the ratio printed.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import numpy as np


def bench_model_config(args):
    from jaxrl.config import ModelConfig

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
        dtype=args.dtype,
        param_dtype="float32",
    )


def make_inputs(args, vocab: int):
    rng = np.random.default_rng(0)
    b, t = args.batch, args.seq
    tokens = rng.integers(0, vocab, (b, t)).astype(np.int32)
    mask = np.zeros((b, t), np.float32)
    mask[:, t // 4 :] = 1.0  # a quarter prompt, three quarters completion
    rewards = rng.integers(0, 2, b).astype(np.float32)
    groups = np.repeat(np.arange(b // 4), 4).astype(np.int32)
    return tokens, mask, rewards, groups


def bench_jax(args, model_cfg, inputs):
    import jax

    from jaxrl.config import MeshConfig
    from jaxrl.sharding import make_meshes
    from jaxrl.train.batch import make_batch
    from jaxrl.train.config import TrainConfig
    from jaxrl.train.trainer import Trainer

    n = len(jax.devices())
    mesh = make_meshes(MeshConfig(trainer=(n, 1), generator=(n, 1), colocated=True)).trainer
    cfg = TrainConfig(
        lr=1e-5, micro_batches=args.micro_batches, remat=args.remat, logprob_chunk=args.chunk
    )
    trainer = Trainer(model_cfg, cfg, mesh)
    batch = make_batch(*inputs)
    times, mfus = [], []
    for i in range(args.warmup + args.steps):
        m = trainer.step(batch)
        if m is not None and i > args.warmup:  # metrics of step i-1; step 0 compiles
            times.append(m["train/step_s"])
            mfus.append(m["train/mfu"])
    m = trainer.flush()
    times.append(m["train/step_s"])
    mfus.append(m["train/mfu"])
    return statistics.median(times), statistics.median(mfus), trainer._peak


def bench_torch(args, model_cfg, inputs):
    import torch
    import transformers

    torch.set_num_threads(args.torch_threads)
    hf_cfg = transformers.Qwen2Config(
        vocab_size=model_cfg.vocab_size,
        hidden_size=model_cfg.hidden_size,
        intermediate_size=model_cfg.intermediate_size,
        num_hidden_layers=model_cfg.num_layers,
        num_attention_heads=model_cfg.num_heads,
        num_key_value_heads=model_cfg.num_kv_heads,
        max_position_embeddings=model_cfg.max_position_embeddings,
        tie_word_embeddings=True,
        rope_theta=model_cfg.rope_theta,
        rms_norm_eps=model_cfg.rms_norm_eps,
    )
    torch.manual_seed(0)
    model = transformers.Qwen2ForCausalLM(hf_cfg).float().train()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-5, weight_decay=0.01)
    tokens, mask, rewards, groups = (torch.as_tensor(x) for x in inputs)
    r = rewards.view(-1, 4)
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

    times = []
    for i in range(args.warmup + args.steps):
        t0 = time.perf_counter()
        step()
        if i >= args.warmup:
            times.append(time.perf_counter() - t0)
    return statistics.median(times)


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench.py train", description=__doc__.splitlines()[0])
    p.add_argument("--vs", choices=["torch", "none"], default="none")
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--steps", type=int, default=5, help="timed steps")
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--micro-batches", type=int, default=1)
    p.add_argument("--remat", default="none")
    p.add_argument("--chunk", type=int, default=128, help="logprob chunk (tokens)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--torch-threads", type=int, default=2)
    args = p.parse_args(argv)

    from jaxrl.train.flops import train_flops_per_token

    from jaxrl.train.flops import peak_flops

    peak_flops(refresh=True)  # re-measure now; the cache keeps the best seen on this machine
    model_cfg = bench_model_config(args)
    inputs = make_inputs(args, model_cfg.vocab_size)
    tokens = args.batch * args.seq
    step_s, mfu, peak = bench_jax(args, model_cfg, inputs)
    out = {
        "model_params": model_cfg.num_params(),
        "batch": args.batch,
        "seq": args.seq,
        "flops_per_token": train_flops_per_token(model_cfg, args.seq),
        "peak_flops": peak,
        "jax_step_s": step_s,
        "jax_tokens_per_s": tokens / step_s,
        "jax_mfu": mfu,
    }
    print(
        f"jax   : {tokens / step_s:9.1f} tokens/s  step {step_s:.3f}s  MFU {mfu:.1%} "
        f"(peak {peak / 1e9:.1f} GFLOP/s)",
        flush=True,
    )
    if args.vs == "torch":
        t_s = bench_torch(args, model_cfg, inputs)
        t_mfu = train_flops_per_token(model_cfg, args.seq) * tokens / t_s / peak
        out.update(
            torch_step_s=t_s,
            torch_tokens_per_s=tokens / t_s,
            torch_mfu=t_mfu,
            ratio_vs_torch=t_s / step_s,
        )
        print(f"torch : {tokens / t_s:9.1f} tokens/s  step {t_s:.3f}s  MFU {t_mfu:.1%}")
        print(f"jax / torch tokens/s: {t_s / step_s:.2f}x")
    print(json.dumps(out))
    return 0
