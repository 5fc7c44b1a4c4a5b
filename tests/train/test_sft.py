"""SFT warm start: the loss falls, a short run solves some held-out pysynth problems, and the cache
is keyed, atomic and reused."""

from __future__ import annotations

import dataclasses

import jax
import numpy as np
import pytest

from jaxrl.data.config import DataConfig, SFTConfig
from jaxrl.data.tasks import build_task
from jaxrl.sharding import make_mesh
from jaxrl.testing import tiny_model_config
from jaxrl.tokenizers import CharTokenizer
from jaxrl.train import sft as sft_mod


@pytest.fixture(scope="module")
def mesh():
    return make_mesh((1, 1), "trainer", jax.devices()[:1])


def test_sft_rows_mask_only_the_demonstration():
    tok = CharTokenizer()
    cfg = DataConfig()
    task = build_task(cfg)
    recs = [task.source("train")[i] for i in range(3)]
    b = sft_mod.sft_rows(task, recs, tok, "plain", 64)
    assert b.tokens.shape == (3, 48)  # padded to the longest row, rounded up to 16
    for i, r in enumerate(recs):
        n_prompt = len(r["prompt"]) + 1  # + BOS
        n_demo = len(r["reference"]) + 1  # + EOS
        assert b.loss_mask[i].sum() == n_demo and b.loss_mask[i, :n_prompt].sum() == 0
        assert tok.decode(b.tokens[i, n_prompt:n_prompt + n_demo]) == r["reference"]
        assert b.segment_ids[i].sum() == n_prompt + n_demo
    with pytest.raises(ValueError, match=r"exceeds data.sft.max_len=8"):
        sft_mod.sft_rows(task, recs, tok, "plain", 8)


def test_cache_is_keyed_atomic_and_reused(tmp_path, mesh, monkeypatch):
    model_cfg = tiny_model_config(num_layers=1, hidden_size=32, intermediate_size=64)
    cfg = DataConfig(sft=SFTConfig(steps=2, batch_size=4, cache_dir=str(tmp_path)))
    tok = CharTokenizer()
    params, info = sft_mod.warm_start(model_cfg, cfg, mesh=mesh, tokenizer=tok)
    assert not info["cache_hit"] and (tmp_path / f"sft-{info['key']}" / "meta.json").is_file()
    again, info2 = sft_mod.warm_start(model_cfg, cfg, mesh=mesh, tokenizer=tok)
    assert info2["cache_hit"] and info2["key"] == info["key"]
    jax.tree.map(np.testing.assert_array_equal, jax.device_get(params), jax.device_get(again))
    assert info["code"] == sft_mod.code_stamp()

    # an interrupted write leaves no cache entry (and no temporary directory) behind
    def interrupted(params, path):
        path.mkdir(parents=True)
        (path / "half-written").write_text("")
        raise KeyboardInterrupt

    monkeypatch.setattr(sft_mod, "_save_params", interrupted)
    with pytest.raises(KeyboardInterrupt):
        sft_mod._write_atomic(tmp_path / "sft-other", params, {})
    assert sorted(p.name for p in tmp_path.iterdir()) == [f"sft-{info['key']}"]

    # eval/pipeline settings do not change the key; task, model and SFT settings do
    key = sft_mod.cache_key
    assert key(model_cfg, dataclasses.replace(cfg, eval_every=7, group_size=4), tok) == info["key"]
    assert key(model_cfg, dataclasses.replace(cfg, difficulty=2), tok) != info["key"]
    assert key(model_cfg, dataclasses.replace(cfg, sft=SFTConfig(steps=3)), tok) != info["key"]
    assert key(dataclasses.replace(model_cfg, num_layers=2), cfg, tok) != info["key"]
    assert sft_mod.warm_start(model_cfg, dataclasses.replace(cfg, sft=SFTConfig(steps=0)),
                              mesh=mesh, tokenizer=tok)[0] is None


def test_a_cache_hit_from_other_code_is_used_with_a_warning(tmp_path, mesh, caplog):
    import json

    model_cfg = tiny_model_config(num_layers=1, hidden_size=32, intermediate_size=64)
    cfg = DataConfig(sft=SFTConfig(steps=1, batch_size=4, cache_dir=str(tmp_path)))
    tok = CharTokenizer()
    _, info = sft_mod.warm_start(model_cfg, cfg, mesh=mesh, tokenizer=tok)
    with caplog.at_level("WARNING", logger="jaxrl.train.sft"):
        assert sft_mod.warm_start(model_cfg, cfg, mesh=mesh, tokenizer=tok)[1]["cache_hit"]
    # only this module's warnings: other libraries' threads (an SDK heartbeat) may log meanwhile
    assert not [r for r in caplog.records
                if r.levelname == "WARNING" and r.name == "jaxrl.train.sft"]
    meta_path = tmp_path / f"sft-{info['key']}" / "meta.json"
    meta = json.loads(meta_path.read_text())
    meta_path.write_text(json.dumps({**meta, "code": "made-by-older-code"}))
    with caplog.at_level("WARNING", logger="jaxrl.train.sft"):
        _, hit = sft_mod.warm_start(model_cfg, cfg, mesh=mesh, tokenizer=tok)
    assert hit["cache_hit"]
    warned = [r.getMessage() for r in caplog.records
              if r.levelname == "WARNING" and r.name == "jaxrl.train.sft"]
    assert len(warned) == 1 and str(meta_path.parent) in warned[0]
    assert "--data.sft.cache=false" in warned[0]
