"""The service's log-prob pass (jaxrl/service/compute.py) is the model's own log-softmax at each
target, final logit soft-capping included (Gemma 2: without it the service returned uncapped
log-probs)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from jaxrl.config import LoraConfig
from jaxrl.models import lora
from jaxrl.models.transformer import Transformer
from jaxrl.presets import tiny_model_config
from jaxrl.service import compute


def test_logprobs_are_the_soft_capped_models_log_softmax():
    cfg = dataclasses.replace(
        tiny_model_config(hidden_size=32, intermediate_size=64, num_heads=2, num_kv_heads=1),
        final_logit_softcap=2.0, lora=LoraConfig(rank=2))
    model = Transformer(cfg, rngs=nnx.Rngs(0))
    graphdef, state = nnx.split(model)
    base, adapters = lora.split(nnx.to_pure_dict(state))
    tokens = jnp.asarray(np.random.default_rng(0).integers(1, cfg.vocab_size, (2, 7)), jnp.int32)
    targets = jnp.roll(tokens, -1, axis=1)
    got = compute.jit_logprobs(graphdef)(adapters, base, tokens, targets)
    logits = model(tokens)  # soft-capped by the model: |logit| < 2
    assert float(jnp.max(jnp.abs(logits))) < 2.0
    want = jnp.take_along_axis(jax.nn.log_softmax(logits.astype(jnp.float32), -1),
                               targets[..., None], -1)[..., 0]
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), rtol=1e-5, atol=1e-5)
