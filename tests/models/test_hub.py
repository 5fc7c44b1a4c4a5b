"""Models and tokenizers by Hugging Face Hub id: resolved from the local Hugging Face cache (laid
out here as `huggingface-cli download` leaves it: blobs, snapshot symlinks, refs/main), a clear
error offline, and `launch/run.py --init org/name` run offline from that cache (a tiny Gemma 3 with
sliding-window layers: the run trains and exports it past its window)."""

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.config import ConfigError, RunConfig
from jaxrl.models.hub import resolve
from jaxrl.testing import make_hf_model
from jaxrl.tokenizers import CharTokenizer, HFTokenizer, load_tokenizer

ROOT = Path(__file__).resolve().parents[2]
REPO = "tiny-org/tiny-gemma3"
REVISION = "0123456789abcdef0123456789abcdef01234567"
CHATML = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n"
          "{% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
QUESTIONS = ["Nat sold 48 clips and then 24 more. How many clips?",
             "Bo has 30 coins and gets 12. How many coins now?",
             "A box holds 6 eggs. How many eggs are in 4 boxes?",
             "Sam read 15 pages and then 9 pages. How many pages?"]


def tiny_tokenizer(path: Path) -> None:
    """A byte-level BPE `tokenizer.json` (vocab 300) with a ChatML template, as a Hub repo
    ships it (tokenizer.json + tokenizer_config.json)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<unk>", "<|im_start|>", "<|im_end|>", "<|endoftext|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator([*QUESTIONS, "Solve it step by step \\boxed{} 0123456789"] * 20,
                            trainer)
    path.mkdir(parents=True, exist_ok=True)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(json.dumps(
        {"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": CHATML,
         "tokenizer_class": "PreTrainedTokenizerFast"}))


def put_in_hf_cache(hub_cache: Path, repo: str, files: Path) -> Path:
    """The HF cache layout: models--org--name/{blobs/<sha256>, snapshots/<rev>/<file> -> blob,
    refs/main = <rev>}. Returns the snapshot directory."""
    root = hub_cache / ("models--" + repo.replace("/", "--"))
    snap = root / "snapshots" / REVISION
    (root / "blobs").mkdir(parents=True)
    snap.mkdir(parents=True)
    for f in sorted(files.iterdir()):
        data = f.read_bytes()
        blob = root / "blobs" / hashlib.sha256(data).hexdigest()
        blob.write_bytes(data)
        (snap / f.name).symlink_to(os.path.relpath(blob, snap))
    (root / "refs").mkdir()
    (root / "refs" / "main").write_text(REVISION)
    return snap


@pytest.fixture(scope="module")
def hf_home(tmp_path_factory):
    """HF_HOME with `tiny-org/tiny-gemma3` (a tiny random Gemma 3, window 8, + its tokenizer) in
    its cache."""
    from windowed_models import make_windowed_hf

    home = tmp_path_factory.mktemp("hf_home")
    files = tmp_path_factory.mktemp("repo_files")
    make_windowed_hf("gemma3", files, vocab_size=320, max_position_embeddings=512)
    tiny_tokenizer(files)
    put_in_hf_cache(home / "hub", REPO, files)
    return home


@pytest.fixture
def offline_cache(hf_home, monkeypatch):
    import huggingface_hub.constants as constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    return hf_home / "hub"


def test_the_cache_layout_is_the_one_huggingface_hub_reads(hf_home):
    """Independent of jaxrl: huggingface_hub itself finds the files in the layout built here."""
    from huggingface_hub import try_to_load_from_cache

    found = try_to_load_from_cache(REPO, "config.json", cache_dir=str(hf_home / "hub"))
    assert isinstance(found, str)
    assert json.loads(Path(found).read_text())["model_type"] == "gemma3_text"


def test_hub_id_resolves_from_the_cache_offline(offline_cache):
    snap = resolve(REPO)
    assert snap == offline_cache / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION
    assert (snap / "model.safetensors").is_file()


def test_tokenizer_defaults_to_the_models_own(offline_cache):
    """Before: the default was "char" whatever `init` was, and "auto" was not a value."""
    assert RunConfig().tokenizer == "auto"
    tok = load_tokenizer("auto", init=REPO)
    assert isinstance(tok, HFTokenizer) and tok.vocab_size == 300
    assert tok.decode(tok.encode(QUESTIONS[0])) == QUESTIONS[0]
    assert isinstance(load_tokenizer("auto"), CharTokenizer)  # no init: the demo's tokenizer
    assert isinstance(load_tokenizer(REPO), HFTokenizer)  # a Hub id as --tokenizer


def test_auto_tokenizer_for_a_model_without_one(tmp_path):
    make_hf_model("qwen2", tmp_path)
    with pytest.raises(ConfigError, match="has no tokenizer.json.*--tokenizer=char"):
        load_tokenizer("auto", init=str(tmp_path))


def test_offline_and_not_cached_says_how_to_fetch(offline_cache):
    """Before: `--tokenizer Org/Model` raised a raw FileNotFoundError (and `--init` the same)."""
    with pytest.raises(ConfigError) as e:
        load_tokenizer("Qwen/Qwen2.5-0.5B-Instruct")
    msg = str(e.value)
    assert "tokenizer='Qwen/Qwen2.5-0.5B-Instruct'" in msg and "offline" in msg
    assert "huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct" in msg and "HF_HOME" in msg
    with pytest.raises(ConfigError, match="init='Qwen/Qwen2.5-0.5B-Instruct': it is not in"):
        resolve("Qwen/Qwen2.5-0.5B-Instruct")


def test_not_a_path_nor_a_hub_id(tmp_path):
    with pytest.raises(ConfigError, match="no such directory, and not a Hugging Face Hub id"):
        resolve(str(tmp_path / "missing"))
    with pytest.raises(ConfigError, match="has no config.json"):
        resolve(str(tmp_path))


def test_online_download_failure_is_one_clear_error(offline_cache, monkeypatch):
    """Online (HF_HUB_OFFLINE unset) but the Hub unreachable: the download is tried, and its
    failure is a ConfigError with the fix, not a traceback from deep inside the HTTP client."""
    import huggingface_hub.constants as constants

    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens there
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    with pytest.raises(ConfigError, match="downloading it failed.*huggingface-cli download"):
        resolve("nobody/not-cached")


def resolve_in(hf_home: Path) -> Path:
    return hf_home / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / REVISION


@pytest.mark.slow
def test_launch_run_with_a_hub_id_offline(hf_home, tmp_path, monkeypatch):
    """`launch/run.py --init tiny-org/tiny-gemma3`, offline, the model and its tokenizer from the
    HF cache, 3 steps in periodic mode; then the run exports to a directory `transformers` reads,
    tokenizer included, with jaxrl's logits past the window."""
    data = tmp_path / "gsm8k.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": f"Add.\n#### {i}"}) + "\n"
                            for i, q in enumerate(QUESTIONS * 2)))
    env = dict(os.environ, HF_HOME=str(hf_home), HF_HUB_OFFLINE="1", JAX_PLATFORMS="cpu")
    env.pop("HF_HUB_CACHE", None)
    cmd = [sys.executable, str(ROOT / "launch" / "run.py"),
           "--config", str(ROOT / "tests" / "rl" / "tiny_config.py"), "--quiet",
           f"--init={REPO}", "--name=hub", "--pipeline.steps=3", "--pipeline.mode=periodic",
           "--data.task=gsm8k_jsonl",
           f"--data.paths={data}", f"--data.eval_paths={data}", "--data.eval_size=2",
           "--data.epochs=0", "--data.max_new_tokens=4", "--train.checkpoint_every=3"]
    proc = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    run_dir = tmp_path / "runs" / "hub"
    recorded = json.loads((run_dir / "config.json").read_text())
    assert recorded["init"] == REPO and recorded["tokenizer"] == "auto"
    assert (run_dir / "checkpoints" / "3").is_dir()
    assert len((run_dir / "metrics.jsonl").read_text().splitlines()) == 3

    import huggingface_hub.constants as constants
    import transformers

    from jaxrl.train.export import export_run

    out = tmp_path / "export"
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(hf_home / "hub"))
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    info = export_run(run_dir, out)
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json",
            "model.safetensors", "config.json"} <= set(info["files"])
    snap = resolve_in(hf_home)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        assert (out / name).read_bytes() == (snap / name).read_bytes()
    # transformers reads the export's tokenizer as it reads the source model's (transformers 5
    # may build its own tokenizer class for the model's config.json, with its own pre-tokenizer,
    # so this synthetic BPE is not compared with jaxrl's encoding here: tests/test_tokenizers.py
    # does)
    hf_tok = transformers.AutoTokenizer.from_pretrained(str(out))
    src_tok = transformers.AutoTokenizer.from_pretrained(str(snap))
    assert type(hf_tok) is type(src_tok)
    for q in QUESTIONS:
        assert hf_tok.encode(q) == src_tok.encode(q)
    ours = HFTokenizer(out)
    gen = json.loads((out / "generation_config.json").read_text())
    assert gen["eos_token_id"] == ours.eos_id == hf_tok.convert_tokens_to_ids("<|im_end|>")
    model = transformers.AutoModelForCausalLM.from_pretrained(str(out)).float().eval()
    assert model.config.vocab_size == 320 and type(model).__name__ == "Gemma3ForCausalLM"
    # the trained, exported Gemma 3 gives jaxrl's logits in transformers, 3x past its window
    import numpy as np
    import torch

    from jaxrl.models import load_pretrained

    tokens = np.arange(24)[None] % 320
    with torch.no_grad():
        ref = model(input_ids=torch.tensor(tokens)).logits.numpy()
    _, ours = load_pretrained(out, "float32")
    np.testing.assert_allclose(np.asarray(ours(tokens)), ref, atol=1e-4, rtol=0)
