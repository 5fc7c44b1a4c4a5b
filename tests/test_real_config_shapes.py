"""The shipped real-model config builds the right shapes (no weights needed: jax.eval_shape)."""

from pathlib import Path

import jax
from flax import nnx

from jaxrl.config import load_config
from jaxrl.models.model import abstract_model
from jaxrl.train.state import train_state_shardings

CONFIG = Path(__file__).parent.parent / "configs" / "qwen2_5_0_5b_gsm8k.py"


def test_qwen2_5_0_5b_shapes_and_sharded_state():
    cfg = load_config(CONFIG)
    model = abstract_model(cfg.model)
    params = nnx.state(model, nnx.Param)
    n = sum(x.size for x in jax.tree.leaves(params))
    # Qwen2.5-0.5B has 494,032,768 parameters (tied embeddings).
    assert n == 494_032_768 == cfg.model.num_params()
    assert model.layers[0].attn.q_proj.get_value().shape == (896, 14, 64)
    assert model.layers[0].attn.k_proj.get_value().shape == (896, 2, 64)
    assert model.embed.get_value().shape == (151936, 896)
    # The whole train state (params + AdamW moments) shards onto a 4x2 trainer mesh abstractly.
    mesh = jax.make_mesh((4, 2), ("fsdp", "tp"))
    abstract_state, shardings = train_state_shardings(cfg.model, cfg.train, mesh)
    leaves = jax.tree.leaves(abstract_state.params)
    assert sum(x.size for x in leaves) == n
    q = shardings.params["layers"][0]["attn"]["q_proj"]
    assert q.spec[0] == "fsdp" and q.spec[1] == "tp"
