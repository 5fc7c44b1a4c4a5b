"""GSM8K end to end on CPU in about two minutes: a tiny local model, a small GSM8K-format file.

The real recipe's path (a Hugging Face model directory, GSM8K's own JSONL format, chat template,
`math_answer` reward) at toy size, to check a setup before the real run:

    python -m jaxrl.testing gsm8k-recipe runs/gsm8k-tiny     # tiny model + tokenizer + data
    python launch/run.py --config configs/gsm8k_tiny.py

The model is random: it learns nothing worth reporting; the run shows every phase completing
(SFT warm start, evaluation, GRPO steps, checkpoint). `configs/qwen2_5_0_5b_gsm8k.py` is the
real thing.
"""

from jaxrl.config import (
    DataConfig,
    GenerateConfig,
    MeshConfig,
    PipelineConfig,
    RunConfig,
    SFTConfig,
    TrainConfig,
)


def config() -> RunConfig:
    return RunConfig(
        name="gsm8k_tiny",
        init="runs/gsm8k-tiny/model",  # tokenizer "auto": the model's own (a BPE + ChatML)
        mesh=MeshConfig(trainer=(1, 1), generator=(1, 1)),
        train=TrainConfig(lr=1e-4, checkpoint_every=5, logprob_chunk=64),
        data=DataConfig(task="gsm8k_jsonl", paths=("runs/gsm8k-tiny/train.jsonl",),
                        eval_paths=("runs/gsm8k-tiny/test.jsonl",), prompt_format="chat",
                        prompts_per_step=4, group_size=4, max_new_tokens=24, eval_size=8,
                        pass_k=2, epochs=0, sft=SFTConfig(steps=10, batch_size=8, max_len=160,
                                                          cache=False)),
        generate=GenerateConfig(num_slots=16, chunk_steps=8),
        pipeline=PipelineConfig(mode="periodic", steps=5),
    )
