"""The suite's budget (tests/suite_budget.py, checked by tests/conftest.py) can fail: a test over
the limit, or too many whole-system runs; load beyond the suite's own workers raises the per-test
limit in proportion."""

import tempfile
from pathlib import Path

from suite_budget import (
    LONG_FILES,
    SLOWEST_TEST_S,
    WHOLE_RUNS_ALLOWED,
    budget_problems,
    long_files_first,
    whole_runs,
)

ROOT = Path(__file__).resolve().parents[1]


def test_a_slow_test_or_too_many_runs_is_a_problem():
    quiet = dict(load=2.0, workers=2, cores=2)
    assert budget_problems({"a": SLOWEST_TEST_S - 1}, WHOLE_RUNS_ALLOWED, **quiet) == []
    slow = budget_problems({"a": 1.0, "b": SLOWEST_TEST_S + 1}, 0, **quiet)
    assert len(slow) == 1 and slow[0].startswith("b took")
    many = budget_problems({}, WHOLE_RUNS_ALLOWED + 1, **quiet)
    assert len(many) == 1 and "extend a shared run" in many[0]
    # a machine twice as loaded as the suite itself makes: twice the time allowed
    assert budget_problems({"b": 1.9 * SLOWEST_TEST_S}, 0, load=6.0, workers=2, cores=2) == []


def test_run_directories_are_counted_and_copies_once():
    # outside the session's temporary directories, which the budget counts
    with tempfile.TemporaryDirectory() as root:
        for name, files in (("a", {"config.json": "{}", "metrics.jsonl": '{"step": 0}'}),
                            ("b", {"config.json": "{}"}),
                            ("c", {"config.json": '{"c": 1}', "checkpoints": None}),
                            ("d", {"config.json": '{"d": 1}', "metrics.jsonl": '{"step": 0}'}),
                            ("e", {"config.json": "{}", "metrics.jsonl": '{"step": 1}'})):
            (Path(root) / "runs" / name).mkdir(parents=True)
            for f, text in files.items():
                if text is None:
                    (Path(root) / "runs" / name / f).mkdir()
                else:
                    (Path(root) / "runs" / name / f).write_text(text)
        # b never started; d is a copy of a with its config edited
        assert [p.name for p in whole_runs(Path(root))] == ["a", "c", "e"]


def test_the_longest_files_go_first_each_in_its_own_order():
    ids = ["tests/a.py::x", f"{LONG_FILES[1]}::p", "tests/a.py::y", f"{LONG_FILES[0]}::q",
           f"{LONG_FILES[1]}::r"]
    assert [ids[i] for i in long_files_first(ids)] == [
        f"{LONG_FILES[0]}::q", f"{LONG_FILES[1]}::p", f"{LONG_FILES[1]}::r", "tests/a.py::x",
        "tests/a.py::y"]
    missing = [f for f in LONG_FILES if not (ROOT / f).is_file()]
    assert not missing, f"renamed or removed: update suite_budget.LONG_FILES {missing}"
