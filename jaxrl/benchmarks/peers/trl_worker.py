"""TRL's side of `bench.py rl-step`: `GRPOTrainer` on the fixed workload (TRL 1.16, own venv).

    python trl_worker.py ASSETS_DIR [--no-gradient-checkpointing]

16 prompts x 8 generations per step (per_device_train_batch_size 128, one optimizer step per
batch), exactly 64 new tokens (`min_new_tokens` in generation_kwargs bans EOS until the cap),
beta 0 (no reference model), f32 on the CPU. TRL's GRPO checkpoints gradients by default;
`--no-gradient-checkpointing` turns that off (no recomputed forward, more memory). Step time
from a callback (on_step_begin -> on_step_end); generation time from a wrapper around the
trainer's `_generate`; the number of new tokens per sample from the `completion_ids` the reward
function receives.
"""

from __future__ import annotations

import sys
import tempfile
import time

import common


def main(argv: list[str]) -> int:
    assets, *flags = argv
    if flags not in ([], ["--no-gradient-checkpointing"]):
        raise SystemExit(f"unknown arguments {flags}; the only option is "
                         "--no-gradient-checkpointing")
    w = common.load_workload(assets)
    import torch
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    model = AutoModelForCausalLM.from_pretrained(w["model"], dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(w["model"])
    lengths: list[int] = []
    gen_time = [0.0]

    def reward(prompts, completions, completion_ids, **_):
        lengths.extend(len(ids) for ids in completion_ids)
        return [common.lowercase_share(c) for c in completions]

    class Timer(TrainerCallback):
        def on_step_begin(self, args, state, control, **kw):
            lengths.clear()
            gen_time[0] = 0.0
            self.t0 = time.perf_counter()

        def on_step_end(self, args, state, control, **kw):
            step_s = time.perf_counter() - self.t0
            i = state.global_step - 1
            common.emit("step", step=i, warmup=i < w["warmup"], step_s=step_s,
                        gen_s=gen_time[0], train_s=step_s - gen_time[0],
                        rss_gb=common.peak_rss_gb(),
                        new_tokens_mean=sum(lengths) / max(1, len(lengths)),
                        new_tokens_min=min(lengths, default=None),
                        new_tokens_max=max(lengths, default=None), samples=len(lengths))

    n = w["prompts"] * w["group"]
    args = GRPOConfig(
        output_dir=tempfile.mkdtemp(prefix="rl-step-trl-"), per_device_train_batch_size=n,
        gradient_accumulation_steps=1, steps_per_generation=1, num_generations=w["group"],
        max_completion_length=w["new_tokens"],
        generation_kwargs={"min_new_tokens": w["new_tokens"]}, temperature=1.0, top_k=0,
        top_p=1.0, beta=0.0, learning_rate=w["lr"], lr_scheduler_type="constant",
        warmup_steps=0, weight_decay=0.0, max_grad_norm=1.0, bf16=False, use_cpu=True,
        max_steps=w["warmup"] + w["steps"], logging_steps=1, report_to="none",
        save_strategy="no", disable_tqdm=True, seed=0,
        gradient_checkpointing=not flags)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=args,
                          train_dataset=Dataset.from_dict({"prompt": w["texts"]}),
                          processing_class=tokenizer, callbacks=[Timer()])
    inner = trainer._generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*a, **kw)
        finally:
            gen_time[0] += time.perf_counter() - t0

    trainer._generate = timed_generate

    def params():
        return [p.detach().cpu().numpy() for p in trainer.model.parameters()]

    before = common.checksum(params())
    trainer.train()
    common.emit("weights", before=before, after=common.checksum(params()),
                peak_rss_gb=common.peak_rss_gb())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
