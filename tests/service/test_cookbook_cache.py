"""examples/cookbook_offline_cache.py writes a Hugging Face cache that the offline lookups
tinker-cookbook's sl_loop and rl_loop make (tokenizer by name, datasets by name) and
`launch/serve.py --base-model meta-llama/Llama-3.2-1B` (a Hub id resolved from the cache, as
`snapshot_download(local_files_only=True)` here) all find. The recipes
themselves need their own venv (docs/service.md, "tinker-cookbook"); this checks the cache only."""

import importlib.util
import json
from pathlib import Path

import pytest

datasets = pytest.importorskip("datasets", reason="the cache builder needs `datasets`")
ROOT = Path(__file__).resolve().parents[2]


def _builder():
    spec = importlib.util.spec_from_file_location(
        "cookbook_offline_cache", ROOT / "examples" / "cookbook_offline_cache.py")
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_offline_cache_serves_tokenizer_model_and_dataset(tmp_path, monkeypatch):
    from huggingface_hub import snapshot_download
    from tokenizers import Tokenizer

    mod = _builder()
    # not write_model: a jaxrl save_pretrained (tested elsewhere) costs the JAX start-up here
    assert mod.write_tokenizer(mod.snapshot(tmp_path, mod.TOKENIZER_REPO)) == 261
    mod.write_dataset(tmp_path)
    (mod.snapshot(tmp_path, mod.MODEL_REPO) / "config.json").write_text('{"vocab_size": 512}')
    hub = tmp_path / "hub"
    tok_dir = Path(snapshot_download(mod.TOKENIZER_REPO, cache_dir=hub, local_files_only=True))
    tok = Tokenizer.from_file(str(tok_dir / "tokenizer.json"))
    ids = tok.encode("<|begin_of_text|>User: héllo\n\nAssistant:").ids
    assert ids[0] == tok.token_to_id("<|begin_of_text|>") and max(ids) < 512
    assert tok.decode(ids, skip_special_tokens=True) == "User: héllo\n\nAssistant:"
    model_dir = Path(snapshot_download(mod.MODEL_REPO, cache_dir=hub, local_files_only=True))
    assert json.loads((model_dir / "config.json").read_text())["vocab_size"] == 512

    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    ds = datasets.load_dataset(mod.DATASET_REPO, cache_dir=str(tmp_path / "datasets"))
    assert ds["train"].num_rows == 48 and ds["test"].num_rows == 8
    assert ds["train"][0]["messages"][1]["role"] == "assistant"

    mod.write_dataset(tmp_path, mod.GSM8K_REPO, "main", mod.gsm8k_rows, (("train", 6),))
    gsm = datasets.load_dataset(mod.GSM8K_REPO, "main", cache_dir=str(tmp_path / "datasets"))
    row = gsm["train"][5]  # the answer after '####' is the sum the question asks for
    a, b = (int(w) for w in row["question"].split() if w.isdigit())
    assert gsm["train"].num_rows == 6 and row["answer"].endswith(f"#### {a + b}")
