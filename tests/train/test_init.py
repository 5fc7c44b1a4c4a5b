"""The initial policy of a run with `--init`: the Hugging Face weights; a requested SFT warm
start is skipped, and a log line says so (before: skipped silently)."""

import logging

import jax
import numpy as np

from jaxrl.config import DataConfig, RunConfig, SFTConfig
from jaxrl.sharding import make_mesh
from jaxrl.testing import make_hf_model
from jaxrl.tokenizers import CharTokenizer
from jaxrl.train.init import initial_params, model_config


def test_init_with_sft_steps_says_the_warm_start_is_skipped(tmp_path, caplog):
    hf = make_hf_model("qwen2", tmp_path / "hf", vocab_size=128)
    mesh = make_mesh((1, 1), "trainer", jax.devices()[:1])
    tok = CharTokenizer()
    cfg = RunConfig(init=str(tmp_path / "hf"), tokenizer="char",
                    data=DataConfig(task="arith", sft=SFTConfig(steps=20)))
    with caplog.at_level(logging.WARNING, logger="jaxrl"):
        params, metrics = initial_params(cfg, mesh, tok, None, model_config(cfg, tok), None)
    notes = [r.getMessage() for r in caplog.records if "SFT warm start" in r.getMessage()]
    assert notes == [f"init={str(tmp_path / 'hf')!r} gives the starting weights: the SFT warm "
                     "start (data.sft.steps=20) is skipped; --data.sft.steps=0 starts from it "
                     "without this note"], notes
    assert metrics == {}  # no SFT ran
    embed = hf.get_input_embeddings().weight.detach().numpy()
    assert np.array_equal(np.asarray(params["embed"]), embed)  # the init model's weights

    caplog.clear()
    no_sft = RunConfig(init=str(tmp_path / "hf"), tokenizer="char",
                       data=DataConfig(task="arith", sft=SFTConfig(steps=0)))
    with caplog.at_level(logging.WARNING, logger="jaxrl"):
        initial_params(no_sft, mesh, tok, None, model_config(no_sft, tok), None)
    assert not [r for r in caplog.records if "SFT warm start" in r.getMessage()]
