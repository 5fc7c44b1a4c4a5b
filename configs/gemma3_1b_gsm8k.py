"""Gemma 3 1B (instruction-tuned) on GSM8K from local files (no downloads): the model and task of
Tunix's GRPO demo.

Needs a local Hugging Face directory of `google/gemma-3-1b-it` (config.json, *.safetensors and
tokenizer files) and the public GSM8K JSONL files, e.g.:

    python launch/run.py --config configs/gemma3_1b_gsm8k.py \\
        --init=/path/to/gemma-3-1b-it --tokenizer=/path/to/gemma-3-1b-it \\
        --data.paths=/path/to/gsm8k/train.jsonl --data.eval_paths=/path/to/gsm8k/test.jsonl

The model section mirrors the checkpoint's config.json (a test checks the shapes with
`jax.eval_shape`: 999,885,952 parameters); with `init` set the shapes are read from its
config.json and the dtype settings here are applied. 26 layers, five sliding-window layers
(512 tokens, rope base 10,000) to each global one (rope base 1,000,000), q/k norms, tied
embeddings of a 262,144-token vocabulary. Memory plans for one H200 and a v5e-8: docs/models.md.
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

SLIDING, FULL = "sliding_attention", "full_attention"


def config() -> RunConfig:
    return RunConfig(
        name="gemma3_1b_gsm8k",
        init="models/gemma-3-1b-it",
        tokenizer="models/gemma-3-1b-it",
        model=ModelConfig(
            architecture="gemma3", vocab_size=262144, hidden_size=1152, intermediate_size=6912,
            num_layers=26, num_heads=4, num_kv_heads=1, head_dim=256, rope_theta=1000000.0,
            rope_local_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=32768,
            tie_embeddings=True, qk_norm=True, query_pre_attn_scalar=256.0,
            sliding_window=512, layer_types=((SLIDING,) * 5 + (FULL,)) * 4 + (SLIDING,) * 2,
            dtype="bfloat16", param_dtype="float32",
        ),
        mesh=MeshConfig(),  # half the devices train, half generate
        # remat per layer, a 64-token lm-head chunk (the 262k vocabulary makes the lm head the
        # largest activation) and 8 micro-batches: 11.9 GiB per v5e chip of 16 (4 of them
        # training); 4 micro-batches need 18.6 GiB there (docs/models.md has the plans)
        train=TrainConfig(lr=1e-6, warmup_steps=10, schedule="cosine", total_steps=500,
                          micro_batches=8, correction="tis_token", logprob_chunk=64,
                          remat="full", checkpoint_every=50, kl_coef=0.0),
        data=DataConfig(task="gsm8k_jsonl", paths=("data/gsm8k/train.jsonl",),
                        eval_paths=("data/gsm8k/test.jsonl",), prompt_format="chat", epochs=0,
                        prompts_per_step=64, group_size=8, max_new_tokens=512, eval_size=256,
                        eval_every=50, pass_k=4),
        generate=GenerateConfig(num_slots=256, chunk_steps=32, dtype="bfloat16"),
        rewards=RewardsConfig(timeout_s=5.0),
        pipeline=PipelineConfig(mode="periodic", steps=500),
    )
