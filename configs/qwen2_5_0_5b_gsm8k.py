"""Qwen2.5-0.5B-Instruct on GSM8K from local files (no downloads).

Needs a local Hugging Face directory with config.json, *.safetensors and tokenizer files, and the
public GSM8K JSONL files, e.g.:

    python launch/run.py --config configs/qwen2_5_0_5b_gsm8k.py \\
        --init=/path/to/Qwen2.5-0.5B-Instruct --tokenizer=/path/to/Qwen2.5-0.5B-Instruct \\
        --data.paths=/path/to/gsm8k/train.jsonl --data.eval_paths=/path/to/gsm8k/test.jsonl

The model section mirrors the checkpoint's shapes (a test checks them with `jax.eval_shape`); when
`init` is set the shapes are read from its config.json and the dtype settings here are applied.
"""

from jaxrl.config import (
    GenerateConfig,
    MeshConfig,
    ModelConfig,
    PipelineConfig,
    RewardsConfig,
    RunConfig,
)
from jaxrl.data.config import DataConfig
from jaxrl.train.config import TrainConfig


def config() -> RunConfig:
    return RunConfig(
        name="qwen2_5_0_5b_gsm8k",
        init="models/Qwen2.5-0.5B-Instruct",
        tokenizer="models/Qwen2.5-0.5B-Instruct",
        model=ModelConfig(
            architecture="qwen2", vocab_size=151936, hidden_size=896, intermediate_size=4864,
            num_layers=24, num_heads=14, num_kv_heads=2, head_dim=64, rope_theta=1000000.0,
            rms_norm_eps=1e-6, max_position_embeddings=32768, tie_embeddings=True,
            qkv_bias=True, dtype="bfloat16", param_dtype="float32",
        ),
        mesh=MeshConfig(),  # half the devices train, half generate
        # remat per layer and a 64-token lm-head chunk: the memory plan of one H200 goes from
        # 224.6 GiB (none, 256) to 48.4 GiB (docs/memory.md)
        train=TrainConfig(lr=1e-6, warmup_steps=10, schedule="cosine", total_steps=500,
                          micro_batches=4, correction="tis_token", logprob_chunk=64,
                          remat="full",
                          checkpoint_every=50, kl_coef=0.0),
        # GSM8K's 7,473 training problems make ~116 steps of 64 prompts: repeat the data (the
        # 500 steps take ~4.3 epochs, more when zero-variance groups are replaced)
        data=DataConfig(task="gsm8k_jsonl", paths=("data/gsm8k/train.jsonl",),
                        eval_paths=("data/gsm8k/test.jsonl",), prompt_format="chat", epochs=0,
                        prompts_per_step=64, group_size=8, max_new_tokens=512, eval_size=256,
                        eval_every=50, pass_k=4),
        generate=GenerateConfig(num_slots=256, chunk_steps=32, dtype="bfloat16"),
        rewards=RewardsConfig(timeout_s=5.0),
        pipeline=PipelineConfig(mode="periodic", steps=500),
    )
