"""Tunix's side of `bench.py rl-step`: its `GRPOLearner` on the fixed workload (Tunix 0.1.7, own
venv).

    python tunix_worker.py ASSETS_DIR

The saved HF weights load through Tunix's own Qwen2 safetensors loader; one CPU device serves as
the actor and rollout mesh (the vanilla rollout engine), beta 0 (no reference model), 16 prompts
x 8 generations and one AdamW update per batch (mini batch = full batch), f32. Exactly 64 new
tokens: the tokenizer Tunix sees (encode / decode over the saved byte tokenizer) names an EOS and
pad id (259) just past the model's 259 logits, which no sample can produce, so every rollout
runs to the cap and the loss masks nothing. Step time wraps the learner's `_run_global_step`
plus the weight sync after it; generation time wraps the cluster's `generate`, whose outputs
also give the number of new tokens per sample.
"""

from __future__ import annotations

import json
import sys
import time

import common
import jax
import jax.numpy as jnp
import numpy as np
import optax
from flax import nnx
from transformers import AutoTokenizer
from tunix.models.qwen2 import model as qwen2
from tunix.models.qwen2 import params as qwen2_params
from tunix.rl import rl_cluster as rl
from tunix.rl.grpo.grpo_learner import GRPOConfig, GRPOLearner
from tunix.rl.rollout import base_rollout

NEVER = 259  # an id no sample can produce: the model has 259 logits (0..258)


class FixedLengthTokenizer:
    """encode / decode of the saved byte tokenizer; EOS and pad are the id no sample reaches."""

    def __init__(self, hf):
        self.hf = hf

    def encode(self, text, **_):
        return self.hf.encode(str(text), add_special_tokens=False)  # numpy str_ from repeats

    def decode(self, ids, **_):
        return self.hf.decode([int(i) for i in ids if int(i) < NEVER])

    def bos_id(self):
        return None

    def eos_id(self):
        return NEVER

    def pad_id(self):
        return NEVER


def main(argv: list[str]) -> int:
    (assets,) = argv
    w = common.load_workload(assets)
    hf_cfg = json.load(open(f"{w['model']}/config.json"))
    heads = hf_cfg["num_attention_heads"]
    rope = (hf_cfg.get("rope_parameters") or {}).get("rope_theta", hf_cfg.get("rope_theta"))
    cfg = qwen2.ModelConfig(
        num_layers=hf_cfg["num_hidden_layers"], vocab_size=hf_cfg["vocab_size"],
        embed_dim=hf_cfg["hidden_size"], hidden_dim=hf_cfg["intermediate_size"],
        num_heads=heads, head_dim=hf_cfg["hidden_size"] // heads,
        num_kv_heads=hf_cfg["num_key_value_heads"], rope_theta=rope,
        norm_eps=hf_cfg["rms_norm_eps"], use_tied_embedding=hf_cfg["tie_word_embeddings"])
    auto = jax.sharding.AxisType.Auto  # Tunix 0.1.7 predates explicit-sharding meshes
    mesh = jax.make_mesh((1, 1), ("fsdp", "tp"), axis_types=(auto, auto))
    model = qwen2_params.create_model_from_safe_tensors(w["model"], cfg, mesh,
                                                        dtype=jnp.float32)

    def params():
        return jax.tree.leaves(jax.device_get(nnx.state(model, nnx.Param)))

    before = common.checksum(params())
    tokenizer = FixedLengthTokenizer(AutoTokenizer.from_pretrained(w["model"]))
    n_prompts, steps = w["prompts"], w["warmup"] + w["steps"]
    optimizer = optax.chain(optax.clip_by_global_norm(1.0),
                            optax.adamw(w["lr"], b1=0.9, b2=0.999, eps=1e-8, weight_decay=0.0))
    rollout = base_rollout.RolloutConfig(
        max_tokens_to_generate=w["new_tokens"], max_prompt_length=w["prompt_tokens"],
        kv_cache_size=w["prompt_tokens"] + w["new_tokens"] + 8, temperature=1.0, top_p=1.0,
        top_k=None, eos_tokens=[NEVER], data_type=jnp.float32)
    training = rl.RLTrainingConfig(
        actor_optimizer=optimizer, eval_every_n_steps=10**9, max_steps=steps,
        mini_batch_size=n_prompts, train_micro_batch_size=n_prompts,
        checkpoint_root_directory=None, pbar_description=None)
    cluster = rl.RLCluster(
        actor=model, reference=None, tokenizer=tokenizer,
        cluster_config=rl.ClusterConfig(
            role_to_mesh={rl.Role.ACTOR: mesh, rl.Role.REFERENCE: mesh, rl.Role.ROLLOUT: mesh},
            rollout_engine="vanilla", offload_to_cpu=False, training_config=training,
            rollout_config=rollout))

    def reward(prompts, completions, **_):
        return [common.lowercase_share(c) for c in completions]

    learner = GRPOLearner(rl_cluster=cluster, reward_fns=reward, algo_config=GRPOConfig(
        num_generations=w["group"], num_iterations=1, beta=0.0, epsilon=0.2))
    lengths: list[int] = []
    gen_time = [0.0]
    inner_generate = cluster.generate

    def timed_generate(*a, **kw):
        t0 = time.perf_counter()
        out = inner_generate(*a, **kw)
        gen_time[0] += time.perf_counter() - t0
        lengths.extend(len(t) for t in out.tokens)
        return out

    cluster.generate = timed_generate
    inner_step, inner_sync = learner._run_global_step, cluster.sync_weights
    step = {"i": 0, "t0": 0.0}

    def emit_step():
        step_s = time.perf_counter() - step["t0"]
        i = step["i"]
        common.emit("step", step=i, warmup=i < w["warmup"], step_s=step_s, gen_s=gen_time[0],
                    train_s=step_s - gen_time[0], rss_gb=common.peak_rss_gb(),
                    new_tokens_mean=sum(lengths) / max(1, len(lengths)),
                    new_tokens_min=min(lengths, default=None),
                    new_tokens_max=max(lengths, default=None), samples=len(lengths))
        step["i"] += 1

    def timed_step(*a, **kw):
        if step["t0"] and step["pending"]:  # no sync followed the previous step
            emit_step()
        lengths.clear()
        gen_time[0] = 0.0
        step.update(t0=time.perf_counter(), pending=True)
        return inner_step(*a, **kw)

    def timed_sync(*a, **kw):
        out = inner_sync(*a, **kw)
        if step.get("pending"):
            step["pending"] = False
            emit_step()
        return out

    learner._run_global_step = timed_step
    cluster.sync_weights = timed_sync
    batch = {"prompts": np.array(w["texts"][:n_prompts])}  # one leaf: Tunix tree-maps repeats
    learner.train([dict(batch) for _ in range(steps)])
    if step.get("pending"):
        emit_step()
    common.emit("weights", before=before, after=common.checksum(params()),
                peak_rss_gb=common.peak_rss_gb())
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
