"""One whole GRPO step on the same fixed workload in jaxrl and in its peers (TRL, Tunix).

    python launch/bench.py rl-step --vs tunix,trl [--shape 22m|100m] [--modes periodic,sync]
                                   [--micro-batches 1,4] [--remat full] [--rounds 3] [--steps 3]
                                   [--share-prompts on|off|both]
                                   [--warmup 2]
                                   [--cache-dir DIR]

The workload (issue 22): a random-init Qwen2-shaped model saved once with `transformers` (f32), a
byte tokenizer of 259 ids, 16 prompts of 40 tokens x 8 samples, exactly 64 new tokens (EOS
ignored), reward = share of a-z characters, one AdamW update per batch, no KL. Every contender
loads the same saved weights, tokenizer and prompts, each in its own process; peers run in their
own virtual environments, built on demand under the cache directory with pinned versions
(`jaxrl/benchmarks/peers/`). Rounds are interleaved (A, B, C, A, B, C, ...); each round reports
the median of its measured steps (after `--warmup` steps), and the summary gives medians over
rounds and the median of the per-round paired ratios, with the load average around each run.
A contender fails loudly (and the command exits 1) unless it generated exactly the fixed number
of new tokens per sample, loaded the saved weights (checksum) and changed them.

`--micro-batches` runs each jaxrl mode once per value of `train.micro_batches` (rows
`jaxrl-sync-mb4`, ...; 1 keeps the plain name). The default, 1, is what the TRL worker does: one
forward/backward over all 128 rows (per_device_train_batch_size 128, no gradient accumulation).
`--remat` sets jaxrl's `train.remat` for its rows (TRL's GRPO checkpoints gradients by default).
`--share-prompts off` runs jaxrl with `train.share_prompts=False` (each sample's prompt computed
again in the update, as the peers do; rows suffixed `-noshare`); `both` runs each jaxrl row with
and without, interleaved: the paired A/B of that setting.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import os
import statistics
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

from safetensors.numpy import load_file
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from jaxrl.benchmarks import missing_packages
from jaxrl.config.train import REMAT_NAMES  # plain Python: the CLI still answers before JAX loads

print = functools.partial(print, flush=True)

PEERS_DIR = Path(__file__).resolve().parent / "peers"
# Qwen2-shaped models (tied embeddings, qkv bias) over the 259-id byte tokenizer. "tiny" is a
# smoke shape for checking the harness, not a benchmark.
SHAPES = {
    "22m": dict(hidden_size=512, num_hidden_layers=8, num_attention_heads=8,
                num_key_value_heads=2, intermediate_size=1408),
    "100m": dict(hidden_size=768, num_hidden_layers=12, num_attention_heads=12,
                 num_key_value_heads=4, intermediate_size=3072),
    "tiny": dict(hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=128),
}
# trl-nogc: TRL with gradient checkpointing off (its GRPO default is on): less work per update,
# more memory; the faster TRL setting where memory allows.
PEERS = ("trl", "trl-nogc", "tunix")
MODES = ("periodic", "sync")
PROMPTS, GROUP, PROMPT_TOKENS, NEW_TOKENS = 16, 8, 40, 64
VOCAB = 259  # 256 bytes + <|endoftext|> (pad) + <|im_start|> + <|im_end|> (EOS)
LR = 1e-6
CHECKSUM_TOL = 1e-9  # relative: two loads of the same f32 weights sum identically in f64


@dataclasses.dataclass(frozen=True)
class Contender:
    name: str  # row label: jaxrl-periodic, jaxrl-sync, trl, tunix
    worker: str  # script in peers/
    args: tuple[str, ...] = ()
    venv: str | None = None  # key of venv_specs(); None: the current environment


def _split(value: str, allowed: tuple[str, ...], flag: str) -> list[str]:
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in allowed]
    if bad or len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(
            f"{flag} takes distinct names from {','.join(allowed)}, got {value!r}")
    return names


def parse(argv: list[str]) -> argparse.Namespace:
    """Arguments, checked before anything heavy is imported (exits 2 with the reason)."""
    p = argparse.ArgumentParser(prog="bench.py rl-step", description=__doc__.split("\n")[0])
    p.add_argument("--vs", default="trl,tunix",
                   type=lambda v: _split(v, PEERS + ("none",), "--vs"),
                   help="peers, comma-separated: trl,trl-nogc,tunix (or none)")
    p.add_argument("--modes", default="periodic,sync",
                   type=lambda v: _split(v, MODES, "--modes"), help="jaxrl pipeline modes")
    p.add_argument("--micro-batches", default="1", type=_micro_batches,
                   help="jaxrl's train.micro_batches, comma-separated (one row each)")
    p.add_argument("--remat", choices=REMAT_NAMES, default="none",
                   help="jaxrl's train.remat for its rows (TRL's GRPO checkpoints gradients by "
                        "default, which is like 'full'; rows are suffixed -remat-<name>)")
    p.add_argument("--share-prompts", choices=("on", "off", "both"), default="on",
                   help="jaxrl's train.share_prompts for its rows ('off' rows are suffixed "
                        "-noshare; 'both' runs each jaxrl row both ways, an A/B)")
    p.add_argument("--shape", choices=list(SHAPES), default="22m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=3, help="measured steps per run")
    p.add_argument("--warmup", type=int, default=2, help="steps run before the measured ones")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds per worker run")
    p.add_argument("--cache-dir", default=str(Path.home() / ".cache" / "jaxrl" / "bench-venvs"))
    p.add_argument("--json", help="also write the rows and summary to this file")
    args = p.parse_args(argv)
    for name in ("rounds", "steps"):
        if getattr(args, name) < 1:
            p.error(f"--{name} must be >= 1, got {getattr(args, name)}")
    if args.warmup < 0 or args.timeout <= 0:
        p.error(f"--warmup must be >= 0 and --timeout > 0, got {args.warmup}, {args.timeout}")
    if why := missing_packages("bench.py rl-step (it writes the workload's weights and "
                               "tokenizer with them)"):
        p.error(why)
    args.vs = [v for v in args.vs if v != "none"]
    return args


def _micro_batches(value: str) -> list[int]:
    """Distinct `train.micro_batches` values, each dividing the batch's rows (no padding)."""
    rows = PROMPTS * GROUP
    try:
        ks = [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        ks = []
    if not ks or len(set(ks)) != len(ks) or any(k < 1 or rows % k for k in ks):
        raise argparse.ArgumentTypeError(
            f"--micro-batches takes distinct divisors of the {rows} rows per step "
            f"(1,2,4,...), got {value!r}")
    return ks


def contenders(modes: list[str], peers: list[str],
               micro_batches: tuple[int, ...] | list[int] = (1,),
               remat: str = "none", share_prompts: str = "on") -> list[Contender]:
    tail = "" if remat == "none" else f"-remat-{remat}"

    def jaxrl_row(m: str, k: int, share: str) -> Contender:
        name = f"jaxrl-{m}" + (f"-mb{k}" if k > 1 else "") + tail
        args = (m, str(k))
        if remat != "none" or share == "off":
            args += (remat,)
        if share == "off":
            name, args = name + "-noshare", args + ("noshare",)
        return Contender(name, "jaxrl_worker.py", args)

    shares = ("on", "off") if share_prompts == "both" else (share_prompts,)
    rows = [jaxrl_row(m, k, share) for m in modes for k in micro_batches for share in shares]
    peer_rows = {"trl": Contender("trl", "trl_worker.py", (), "trl"),
                 "trl-nogc": Contender("trl-nogc", "trl_worker.py",
                                       ("--no-gradient-checkpointing",), "trl"),
                 "tunix": Contender("tunix", "tunix_worker.py", (), "tunix")}
    return rows + [peer_rows[p] for p in peers]


def interleave(items: list, rounds: int) -> list[tuple[int, object]]:
    """(round, item) in the order they run: every item once per round, rounds in turn."""
    return [(r, item) for r in range(rounds) for item in items]


# --- virtual environments -------------------------------------------------------------------


def venv_specs() -> dict[str, list[str]]:
    """Pinned requirements per peer. TRL gets this environment's transformers, so both sides
    read the saved weights the same way, and torch's CPU wheel (an unpinned torch pulls the CUDA
    build). Tunix 0.1.7 gets this environment's jax / jaxlib / flax; its `safetensors<0.8` rules
    out transformers >= 5.13 (which needs safetensors >= 0.8), so transformers 5.12.1, what pip
    resolves for these pins."""
    return {
        "trl": ["trl==1.16.0", "torch==2.13.0", f"transformers=={version('transformers')}"],
        "tunix": ["google-tunix==0.1.7", f"jax=={version('jax')}", f"jaxlib=={version('jaxlib')}",
                  f"flax=={version('flax')}", "transformers==5.12.1"],
    }


def venv_dir(cache: Path, name: str, spec: list[str]) -> Path:
    """<cache>/<name>-<pins>, e.g. trl-trl1.16.0-torch2.13.0-transformers5.24.0."""
    pins = "-".join(s.replace("google-", "").replace("==", "") for s in spec)
    return cache / f"{name}-{pins}"


def ensure_venv(cache: Path, name: str, spec: list[str]) -> tuple[Path | None, str]:
    """(python of the venv, "") once it is built (a marker file records a complete install),
    else (None, why). Built with this interpreter's `venv` and pip; the log sits beside it."""
    path = venv_dir(cache, name, spec)
    python, marker = path / "bin" / "python", path / ".rl-step-complete"
    if marker.exists():
        return python, ""
    log = path.parent / f"{path.name}.log"
    print(f"building {path} ({' '.join(spec)}); log: {log}")
    cache.mkdir(parents=True, exist_ok=True)
    with open(log, "a") as out:
        ok = subprocess.run([sys.executable, "-m", "venv", str(path)], stdout=out,
                            stderr=subprocess.STDOUT).returncode == 0
        ok = ok and subprocess.run([str(python), "-m", "pip", "install", "-q", *spec],
                                   stdout=out, stderr=subprocess.STDOUT).returncode == 0
    if not ok:
        tail = log.read_text().strip().splitlines()[-3:]
        return None, f"venv {path.name} could not be built: {' | '.join(tail)}"
    marker.write_text(" ".join(spec) + "\n")
    return python, ""


# --- the saved workload ---------------------------------------------------------------------


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> printable character map (the one tokenizers' ByteLevel uses)."""
    keep = list(range(33, 127)) + list(range(161, 173)) + list(range(174, 256))
    chars, n = list(keep), 0
    for b in range(256):
        if b not in keep:
            keep.append(b)
            chars.append(256 + n)
            n += 1
    return dict(zip(keep, map(chr, chars), strict=True))


def byte_tokenizer():
    """The 259-id byte tokenizer as a `transformers` fast tokenizer: 256 byte tokens, then
    <|endoftext|> (pad), <|im_start|> and <|im_end|> (EOS). `bench.py generate --vs ct2` saves it
    beside its weights too (CTranslate2's converter reads a tokenizer)."""
    from transformers import PreTrainedTokenizerFast

    specials = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    vocab = {ch: b for b, ch in bytes_to_unicode().items()}
    vocab.update({s: 256 + i for i, s in enumerate(specials)})
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens(specials)
    return PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>",
                                   pad_token="<|endoftext|>")


def prompt_texts() -> list[str]:
    """PROMPTS ASCII prompts of exactly PROMPT_TOKENS bytes (one byte = one token)."""
    words = "the quick brown fox jumps over a lazy dog and then sleeps".split()
    texts = []
    for i in range(PROMPTS):
        text = f"Task {i:02d}:"
        j = i
        while len(text) < PROMPT_TOKENS:
            text += " " + words[j % len(words)]
            j += 3
        texts.append(text[:PROMPT_TOKENS])
    return texts


def save_assets(cache: Path, shape: str, args: argparse.Namespace) -> Path:
    """<cache>/assets-<shape>: model/ (HF Qwen2 config + safetensors + byte tokenizer),
    prompts.jsonl and workload.json; the weights are made once (seed 0) and reused."""
    out = cache / f"assets-{shape}"
    model = out / "model"
    if not (model / "model.safetensors").exists():
        import torch
        from transformers import Qwen2Config, Qwen2ForCausalLM

        hf_tok = byte_tokenizer()
        torch.manual_seed(0)
        cfg = Qwen2Config(vocab_size=VOCAB, max_position_embeddings=256, tie_word_embeddings=True,
                          eos_token_id=258, pad_token_id=256, bos_token_id=None,
                          torch_dtype="float32", **SHAPES[shape])
        Qwen2ForCausalLM(cfg).save_pretrained(str(model), safe_serialization=True)
        hf_tok.save_pretrained(str(model))
    texts = prompt_texts()
    with open(out / "prompts.jsonl", "w") as f:
        for i, t in enumerate(texts):
            f.write(json.dumps({"uid": f"p{i}", "prompt": t, "answer": ""}) + "\n")
    workload = dict(shape=shape, prompts=PROMPTS, group=GROUP, prompt_tokens=PROMPT_TOKENS,
                    new_tokens=NEW_TOKENS, lr=LR, warmup=args.warmup, steps=args.steps,
                    texts=texts, model=str(model))
    (out / "workload.json").write_text(json.dumps(workload, indent=1))
    return out


def file_checksum(model: Path) -> list[float]:
    sys.path.insert(0, str(PEERS_DIR))
    import common

    return common.checksum(load_file(str(model / "model.safetensors")).values())


# --- runs, checks, summary ------------------------------------------------------------------


def load_average() -> float:
    return os.getloadavg()[0]


def parse_lines(stdout: str) -> tuple[list[dict], dict | None]:
    """(step lines, weights line) from a worker's stdout (lines tagged `RLSTEP `)."""
    steps, weights = [], None
    for line in stdout.splitlines():
        if line.startswith("RLSTEP "):
            obj = json.loads(line[len("RLSTEP "):])
            if obj.get("kind") == "step":
                steps.append(obj)
            elif obj.get("kind") == "weights":
                weights = obj
    return steps, weights


def check_row(steps: list[dict], weights: dict | None, *, new_tokens: int, measured: int,
              saved: list[float] | None) -> list[str]:
    """What is wrong with one run's output ([] = valid): the measured steps all present, every
    sample exactly `new_tokens` long, the saved weights loaded (checksum) and changed."""
    problems = []
    timed = [s for s in steps if not s.get("warmup")]
    if len(timed) != measured:
        problems.append(f"{len(timed)} measured steps reported, expected {measured}")
    for s in timed:
        if s.get("step_s") is None:
            problems.append(f"step {s.get('step')}: no step time")
        mean = s.get("new_tokens_mean")
        if mean is None or abs(mean - new_tokens) > 1e-9:
            problems.append(f"step {s.get('step')}: {mean} new tokens per sample on average, "
                            f"expected exactly {new_tokens}")
        lo, hi = s.get("new_tokens_min", new_tokens), s.get("new_tokens_max", new_tokens)
        if (lo, hi) != (new_tokens, new_tokens):
            problems.append(f"step {s.get('step')}: new tokens per sample in [{lo}, {hi}], "
                            f"expected exactly {new_tokens}")
    if not weights or weights.get("before") is None or weights.get("after") is None:
        problems.append("no parameter checksums reported")
    else:
        before, after = weights["before"], weights["after"]
        if saved is not None and not _close(before, saved):
            problems.append(f"loaded weights' checksum {before} differs from the saved "
                            f"weights' {saved}")
        if _close(before, after, tol=0.0):
            problems.append(f"weights unchanged by the steps (checksum {after})")
    return problems


def _close(a: list[float], b: list[float], tol: float = CHECKSUM_TOL) -> bool:
    return all(abs(x - y) <= tol * max(1.0, abs(x), abs(y)) for x, y in zip(a, b, strict=True))


def round_row(name: str, rnd: int, steps: list[dict], weights: dict | None,
              problems: list[str], load: tuple[float, float], wall_s: float) -> dict:
    """One contender's run in one round: medians over its measured steps."""
    timed = [s for s in steps if not s.get("warmup")]

    def med(key):
        vals = [s[key] for s in timed if s.get(key) is not None]
        return statistics.median(vals) if vals else None

    rss = (weights or {}).get("peak_rss_gb")
    return dict(name=name, round=rnd, step_s=med("step_s"), gen_s=med("gen_s"),
                train_s=med("train_s"), peak_rss_gb=rss, load_before=load[0],
                load_after=load[1], wall_s=wall_s, problems=problems)


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Per contender: medians over valid rounds; per jaxrl mode and peer: the median over
    rounds of (jaxrl step / peer step) in the same round (< 1: jaxrl faster)."""
    out: dict = {"contenders": {}, "ratios": {}}
    ok = [r for r in rows if not r["problems"] and r["step_s"] is not None]
    for n in names:
        mine = [r for r in ok if r["name"] == n]
        out["contenders"][n] = {
            k: (statistics.median([r[k] for r in mine if r[k] is not None])
                if any(r[k] is not None for r in mine) else None)
            for k in ("step_s", "gen_s", "train_s", "peak_rss_gb")} | {"rounds": len(mine)}
    by_round: dict[int, dict[str, float]] = {}
    for r in ok:
        by_round.setdefault(r["round"], {})[r["name"]] = r["step_s"]
    for a in (n for n in names if n.startswith("jaxrl-")):
        for b in (n for n in names if not n.startswith("jaxrl-")):
            paired = [rd[a] / rd[b] for rd in by_round.values() if a in rd and b in rd]
            if paired:
                out["ratios"][f"{a}/{b}"] = {"median": statistics.median(paired),
                                             "paired": paired}
    return out


def run_worker(c: Contender, python: str, assets: Path, timeout: float) -> tuple[str, str, int]:
    """(stdout, stderr tail, exit code) of one worker run in its own process."""
    env = dict(os.environ, PYTHONUNBUFFERED="1", TOKENIZERS_PARALLELISM="false")
    env.pop("XLA_FLAGS", None)  # one CPU device, as a user runs it (not the tests' 8)
    cmd = [python, str(PEERS_DIR / c.worker), str(assets), *c.args]
    try:
        p = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)
    except subprocess.TimeoutExpired as e:
        out = e.stdout.decode() if isinstance(e.stdout, bytes) else (e.stdout or "")
        return out, f"timed out after {timeout:.0f} s", -1
    return p.stdout, "\n".join(p.stderr.strip().splitlines()[-15:]), p.returncode


def fmt(x, spec=".2f") -> str:
    return "-" if x is None else format(x, spec)


def main(argv: list[str]) -> int:
    args = parse(argv)
    cache = Path(args.cache_dir).expanduser()
    cs = contenders(args.modes, args.vs, args.micro_batches, args.remat, args.share_prompts)
    pythons: dict[str, str | None] = {}
    unavailable: dict[str, str] = {}
    specs = venv_specs()
    for c in cs:
        if c.venv is None:
            pythons[c.name] = sys.executable
            continue
        python, why = ensure_venv(cache, c.venv, specs[c.venv])
        if python is None:
            unavailable[c.name] = why
            print(f"UNAVAILABLE {c.name}: {why}")
        pythons[c.name] = str(python) if python else None
    assets = save_assets(cache, args.shape, args)
    saved = file_checksum(assets / "model")
    print(f"workload: shape {args.shape}, {PROMPTS} prompts x {GROUP}, {PROMPT_TOKENS}-token "
          f"prompts, {NEW_TOKENS} new tokens, {args.warmup} warm-up + {args.steps} measured "
          f"steps per run, {args.rounds} rounds; assets {assets}")
    rows = []
    runnable = [c for c in cs if pythons[c.name]]
    for rnd, c in interleave(runnable, args.rounds):
        load0, t0 = load_average(), time.perf_counter()
        stdout, err, rc = run_worker(c, pythons[c.name], assets, args.timeout)
        wall, load1 = time.perf_counter() - t0, load_average()
        steps, weights = parse_lines(stdout)
        problems = check_row(steps, weights, new_tokens=NEW_TOKENS, measured=args.steps,
                             saved=saved)
        if rc != 0:
            problems.insert(0, f"exit code {rc}: {err}")
        row = round_row(c.name, rnd, steps, weights, problems, (load0, load1), wall)
        rows.append(row)
        print(f"round {rnd} {c.name:15s} step {fmt(row['step_s'])} s (gen {fmt(row['gen_s'])}, "
              f"train {fmt(row['train_s'])}), peak RSS {fmt(row['peak_rss_gb'])} GiB, load "
              f"{load0:.1f} -> {load1:.1f}, {wall:.0f} s wall")
        for problem in problems:
            print(f"  FAILED {c.name} round {rnd}: {problem}")
    summary = summarize(rows, [c.name for c in runnable])
    print("\nmedians over valid rounds:")
    for n, s in summary["contenders"].items():
        print(f"  {n:15s} step {fmt(s['step_s'])} s  gen {fmt(s['gen_s'])}  train "
              f"{fmt(s['train_s'])}  peak RSS {fmt(s['peak_rss_gb'])} GiB  ({s['rounds']} rounds)")
    for k, v in summary["ratios"].items():
        paired = ", ".join(f"{x:.2f}" for x in v["paired"])
        print(f"  {k}: median paired step ratio {v['median']:.2f}x ({paired})")
    for n, why in unavailable.items():
        print(f"  {n}: not run ({why})")
    if args.json:
        Path(args.json).write_text(json.dumps(
            {"args": {k: v for k, v in vars(args).items()}, "rows": rows, "summary": summary,
             "unavailable": unavailable}, indent=1))
    failed = any(r["problems"] for r in rows) or bool(unavailable)
    return 1 if failed else 0
