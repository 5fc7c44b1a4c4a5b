"""Build a Hugging Face cache under which a tinker-cookbook recipe runs offline against jaxrl's
service: `python examples/cookbook_offline_cache.py HF_HOME`.

The cookbook's `sl_loop` and `rl_loop` recipes need, before their first request, the tokenizer
of their model name, that name in the cookbook's table of models, and a dataset from the Hub
(`HuggingFaceH4/no_robots`; `openai/gsm8k`, config `main`). This writes, with no network, in
the layouts `huggingface_hub` and `datasets` read offline:

- `hub/models--thinkingmachineslabinc--meta-llama-3-instruct-tokenizer`: the tokenizer the
  cookbook loads for any `meta-llama/Llama-3*` name; here a byte-level one (256 byte tokens, no
  merges) plus Llama 3's special tokens (`<|begin_of_text|>`, `<|eot_id|>`, ...);
- `hub/models--meta-llama--Llama-3.2-1B`: a random 2-layer jaxrl model (vocab 512, covering the
  tokenizer's 261 ids) and the same tokenizer beside it, which `launch/serve.py --base-model
  meta-llama/Llama-3.2-1B` serves under that name with `HF_HUB_OFFLINE=1` (the tokenizer lets
  it serve `rl_loop`'s stop string);
- `datasets/HuggingFaceH4___no_robots/default/0.0.0/<hash>`: 48 chat rows written here, in the
  dataset's columns (`prompt`, `prompt_id`, `messages`, `category`), train and test splits;
- `datasets/openai___gsm8k/main/0.0.0/<hash>`: 32 train / 8 test one-digit sums in gsm8k's columns
  (`question`, `answer` ending `#### <number>`).

Then (docs/service.md, "tinker-cookbook"):

    export HF_HOME=DIR HF_HUB_OFFLINE=1 HF_DATASETS_OFFLINE=1 TINKER_API_KEY=tml-local
    python launch/serve.py --base-model meta-llama/Llama-3.2-1B --port 8000 &
    python -m tinker_cookbook.recipes.sl_loop base_url=http://127.0.0.1:8000 \\
        model_name=meta-llama/Llama-3.2-1B batch_size=8 max_steps=4 log_path=/tmp/sl
    python -m tinker_cookbook.recipes.rl_loop base_url=http://127.0.0.1:8000 \\
        model_name=meta-llama/Llama-3.2-1B batch_size=4 group_size=4 max_tokens=32 \\
        max_steps=3 log_path=/tmp/rl
"""

from __future__ import annotations

import hashlib
import json
import shutil
import sys
import tempfile
from pathlib import Path

TOKENIZER_REPO = "thinkingmachineslabinc/meta-llama-3-instruct-tokenizer"
MODEL_REPO = "meta-llama/Llama-3.2-1B"
DATASET_REPO = "HuggingFaceH4/no_robots"
GSM8K_REPO = "openai/gsm8k"
SPECIAL = ["<|begin_of_text|>", "<|end_of_text|>", "<|start_header_id|>", "<|end_header_id|>",
           "<|eot_id|>"]
REVISION = "0" * 40  # the snapshot's (made-up) commit


def snapshot(hf_home: Path, repo: str) -> Path:
    """An empty snapshot directory of model `repo` in the hub cache, with refs/main naming it."""
    root = hf_home / "hub" / ("models--" + repo.replace("/", "--"))
    (root / "refs").mkdir(parents=True, exist_ok=True)
    (root / "refs" / "main").write_text(REVISION)
    snap = root / "snapshots" / REVISION
    snap.mkdir(parents=True, exist_ok=True)
    return snap


def write_tokenizer(out: Path) -> int:
    """Byte-level BPE without merges + Llama 3's special tokens; returns the vocabulary size."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    alphabet = pre_tokenizers.ByteLevel.alphabet()  # the 256 printable stand-ins for bytes
    vocab = {ch: i for i, ch in enumerate(sorted(alphabet))}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(SPECIAL)
    tok.save(str(out / "tokenizer.json"))
    (out / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "<|begin_of_text|>",
        "eos_token": "<|eot_id|>", "pad_token": "<|end_of_text|>",
        "model_max_length": 1024, "clean_up_tokenization_spaces": False}, indent=2))
    # AutoTokenizer.from_pretrained (transformers 5.5) also reads the repo's config.json
    (out / "config.json").write_text(json.dumps({"model_type": "llama"}))
    (out / "special_tokens_map.json").write_text(json.dumps(
        {"bos_token": "<|begin_of_text|>", "eos_token": "<|eot_id|>"}, indent=2))
    return tok.get_vocab_size()


def write_model(out: Path, vocab_size: int) -> None:
    from flax import nnx

    from jaxrl.models.hf import save_pretrained
    from jaxrl.models.transformer import Transformer
    from jaxrl.presets import tiny_model_config

    cfg = tiny_model_config(vocab_size=vocab_size)
    save_pretrained(Transformer(cfg, rngs=nnx.Rngs(0)), cfg, out)


def rows(n: int, split: str) -> list[dict]:
    topics = ["tea", "rivers", "bicycles", "owls", "bread", "maps", "clocks", "snow"]
    out = []
    for i in range(n):
        t = topics[i % len(topics)]
        prompt = f"Write one sentence about {t} (#{i})."
        answer = f"{t.capitalize()} are worth a closer look; note {i} says so plainly."
        out.append({"prompt": prompt, "prompt_id": hashlib.sha256(
                        f"{split}{i}".encode()).hexdigest(),
                    "messages": [{"content": prompt, "role": "user"},
                                 {"content": answer, "role": "assistant"}],
                    "category": "Generation"})
    return out


def gsm8k_rows(n: int, split: str) -> list[dict]:
    """Sums in gsm8k's format: a word problem, worked steps, then `#### <answer>`. One-digit
    sums (2..8): a model that writes `\\boxed{<digit>}` guesses some right."""
    out = []
    for i in range(n):
        a, b = 1 + i % 4, 1 + (i // 4 + (split == "test")) % 4
        out.append({"question": f"Sam has {a} apples and picks {b} more. How many apples does "
                                "Sam have now?",
                    "answer": f"Sam has {a} + {b} = <<{a}+{b}={a + b}>>{a + b} apples.\n"
                              f"#### {a + b}"})
    return out


def write_dataset(hf_home: Path, repo: str = DATASET_REPO, config: str = "default",
                  make_rows=rows, sizes=(("train", 48), ("test", 8))) -> Path:
    """Prepare the rows with the `json` builder, then move its cache entry to where an offline
    `load_dataset(repo, config)` looks (datasets' `cache` module: the newest
    `<cache>/<owner>___<name>/<config>/<version>/<hash>/` whose dataset_info.json names that
    config)."""
    import datasets

    cache = hf_home / "datasets"
    name = repo.split("/")[1]
    with tempfile.TemporaryDirectory() as tmp:
        files = {}
        for split, n in sizes:
            files[split] = str(Path(tmp) / f"{split}.jsonl")
            Path(files[split]).write_text("".join(json.dumps(r) + "\n"
                                                  for r in make_rows(n, split)))
        builder = datasets.load_dataset_builder("json", data_files=files,
                                                cache_dir=str(Path(tmp) / "cache"))
        builder.download_and_prepare()
        src = Path(builder.cache_dir)
        dest = cache / repo.replace("/", "___") / config / "0.0.0" / src.name
        if dest.exists():
            shutil.rmtree(dest)
        dest.mkdir(parents=True)
        for f in src.iterdir():
            if f.suffix == ".arrow":  # json-train.arrow -> no_robots-train.arrow
                shutil.copyfile(f, dest / f.name.replace("json-", f"{name}-", 1))
        info = json.loads((src / "dataset_info.json").read_text())
        info.update(config_name=config, dataset_name=name, builder_name=name)
        for split in info.get("splits", {}).values():
            split["dataset_name"] = name
        (dest / "dataset_info.json").write_text(json.dumps(info))
    return dest


def main(argv: list[str]) -> int:
    if len(argv) != 1:
        raise SystemExit("usage: python examples/cookbook_offline_cache.py HF_HOME")
    hf_home = Path(argv[0]).absolute()
    vocab = write_tokenizer(snapshot(hf_home, TOKENIZER_REPO))
    write_tokenizer(snapshot(hf_home, MODEL_REPO))
    write_model(snapshot(hf_home, MODEL_REPO), vocab_size=512)
    assert vocab <= 512, vocab
    print(f"tokenizer: {TOKENIZER_REPO} ({vocab} ids)")
    print(f"model: {MODEL_REPO} (random, tiny, vocab 512)")
    print(f"dataset: {DATASET_REPO} -> {write_dataset(hf_home)}")
    gsm8k = write_dataset(hf_home, GSM8K_REPO, "main", gsm8k_rows, (("train", 32), ("test", 8)))
    print(f"dataset: {GSM8K_REPO} (main) -> {gsm8k}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
