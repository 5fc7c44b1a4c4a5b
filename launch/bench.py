"""Benchmarks: `python launch/bench.py <name> [options]`; `--help` after a name lists its options.

Each benchmark compares against a named peer in the same run and prints ratios; figures and the
exact commands are recorded in docs/benchmarks.md.
"""

import importlib
import sys

# name -> (module, what it measures): --help lists these without importing JAX.
BENCHMARKS = {
    "generate": ("jaxrl.benchmarks.generate",
                 "decode tokens/s of the generator (--vs hf,ct2: transformers, CTranslate2)"),
    "train": ("jaxrl.benchmarks.train", "train_step tokens/s and MFU (--vs torch)"),
    "sandbox": ("jaxrl.benchmarks.sandbox", "sandbox pool throughput and latency (HumanEval row)"),
    "reshard": ("jaxrl.benchmarks.reshard", "trainer -> generator weight sync, GB/s"),
    "pipeline": ("jaxrl.benchmarks.pipeline", "one workload in sync, periodic, async, inflight"),
    "kernels": ("jaxrl.benchmarks.kernels", "Pallas attention kernels vs XLA, cuDNN (GPU/TPU)"),
    "math": ("jaxrl.benchmarks.math", "math answer checkers on a hand-labelled set"),
    "agentic": ("jaxrl.benchmarks.agentic", "multi-turn episodes with slow tools"),
    "service": ("jaxrl.benchmarks.service", "the Tinker-compatible service"),
    "suite": ("jaxrl.benchmarks.suite", "the cross-hardware suite (--json OUT.json)"),
    "rl-step": ("jaxrl.benchmarks.rl_step", "one whole GRPO step against TRL and Tunix (--vs)"),
    "rebalance": ("jaxrl.benchmarks.rebalance", "a bad fixed trainer/generator split against auto"),
    "disaggregated": ("jaxrl.benchmarks.disaggregated",
                      "prefill/decode disaggregation against one colocated mesh"),
}


def usage() -> str:
    width = max(map(len, BENCHMARKS))
    lines = [f"  {name:<{width}}  {what}" for name, (_, what) in BENCHMARKS.items()]
    return ("usage: python launch/bench.py NAME [options]   (NAME --help lists its options)\n\n"
            "benchmarks:\n" + "\n".join(lines) + "\n\nfigures and commands: docs/benchmarks.md")


def main(argv: list[str]) -> int:
    if argv and argv[0] in ("-h", "--help"):
        print(usage())
        return 0
    if not argv or argv[0] not in BENCHMARKS:
        got = f"unknown benchmark {argv[0]!r}" if argv else "no benchmark named"
        print(f"error: {got}; valid: {', '.join(BENCHMARKS)}\n\n{usage()}", file=sys.stderr)
        return 2
    module = importlib.import_module(BENCHMARKS[argv[0]][0])  # each exists (tests/test_benchmarks)
    return module.main(argv[1:]) or 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
