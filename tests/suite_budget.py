"""The suite's budget (docs/testing.md), checked by tests/conftest.py when a whole-suite run ends.

The whole suite must pass in 15 minutes on a quiet 2-core machine. Two limits keep it there:
  - no single test over SLOWEST_TEST_S (its setup + call + teardown), scaled up by the load on
    the machine beyond the suite's own workers (CI machines are shared);
  - no more whole-system runs (run directories: jaxrl.run.run, launch/run.py, local_cluster)
    than WHOLE_RUNS_ALLOWED. To check something end to end, extend a shared run (a module
    fixture in tests/rl/) instead of starting another.
"""

import hashlib
from pathlib import Path

SLOWEST_TEST_S = 120.0
WHOLE_RUNS_ALLOWED = 33  # 2026-12-05: 33 (40 that morning, ~51 before); lower it as runs are shared


# The longest test files, longest first (measured: a whole-suite run with a cold compile cache,
# 2026-12-05). conftest.py hands them to the xdist workers first, so the two workers end close
# together instead of one starting a long file when the other is nearly done (longest job first).
LONG_FILES = (
    "tests/rl/test_learning.py", "tests/train/test_shared_prompts.py", "tests/rl/test_run.py",
    "tests/test_device_check.py", "tests/test_multiprocess.py",
    "tests/kernels/test_flash_attention.py", "tests/train/test_step.py",
    "tests/generate/test_paged_cache.py", "tests/models/test_quant.py",
    "tests/test_multiprocess_preemption.py", "tests/rl/test_multiturn_runs.py",
    "tests/rl/test_rebalance_run.py", "tests/test_benchmarks.py", "tests/test_bench_suite.py",
    "tests/rl/test_rebalance_auto.py", "tests/rl/test_run_defects.py",
    "tests/kernels/test_sharded_wiring.py", "tests/models/test_blocked_attention.py",
    "tests/test_gsm8k_recipe.py", "tests/rewards/test_code_trust.py",
    "tests/rl/test_preemption.py", "tests/models/test_gemma.py", "tests/models/test_hub.py",
)


def long_files_first(nodeids: list[str]) -> list[int]:
    """The order to run tests in: LONG_FILES first (in that order), then the rest as collected
    (a stable sort: each file's own order is kept)."""
    rank = {f: i for i, f in enumerate(LONG_FILES)}
    return sorted(range(len(nodeids)),
                  key=lambda i: rank.get(nodeids[i].split("::")[0], len(rank)))


def whole_runs(basetemp: Path) -> list[Path]:
    """Run directories written under this session's temporary directories (a run that stopped
    before its first step wrote no metrics or checkpoints and does not count; a copy of a run,
    e.g. one an export test edits, has the same metrics.jsonl and counts once)."""
    runs, seen = [], set()
    for p in sorted(basetemp.rglob("config.json")):
        metrics = p.parent / "metrics.jsonl"
        if not (metrics.exists() or (p.parent / "checkpoints").exists()):
            continue
        key = hashlib.sha256((metrics if metrics.exists() else p).read_bytes()).hexdigest()
        if key not in seen:
            seen.add(key)
            runs.append(p.parent)
    return runs


def budget_problems(durations: dict[str, float], runs: int, *, load: float, workers: int,
                    cores: int) -> list[str]:
    limit = SLOWEST_TEST_S * (1 + max(0.0, load - workers) / cores)
    problems = [f"{nodeid} took {s:.0f} s, over the {limit:.0f} s a test may take "
                f"({SLOWEST_TEST_S:.0f} s on a quiet machine)"
                for nodeid, s in sorted(durations.items(), key=lambda kv: -kv[1]) if s > limit]
    if runs > WHOLE_RUNS_ALLOWED:
        problems.append(f"{runs} whole-system runs, over the {WHOLE_RUNS_ALLOWED} allowed: extend "
                        "a shared run instead of adding one (tests/suite_budget.py)")
    return problems
