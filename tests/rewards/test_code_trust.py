"""Hostile suite for the code_tests trust boundary: the candidate cannot decide its own verdict.

Each attack below made the single-process harness (code_tests before the judge) give a wrong
solution credit (checked against that code; see the report of issue 17); here each scores 0.
Runs on the real sandbox pool, in both tiers where this machine has them.
"""

from __future__ import annotations

import textwrap
import time

import pytest

from jaxrl.rewards.code.tests import code_tests_batch


def _pool(tier):
    from jaxrl.rewards import LocalSandboxPool

    try:
        return LocalSandboxPool(num_workers=2, tier=tier)
    except RuntimeError as e:
        pytest.skip(f"tier {tier} unavailable here: {e}")


@pytest.fixture(scope="module", params=["A", "B"])
def pool(request):
    with _pool(request.param) as p:
        yield p


def score(pool, completion, tests, dedent=True, **kw):
    code = textwrap.dedent(completion) if dedent else completion
    (s,) = code_tests_batch([{"completion": code, "tests": tests}],
                            pool=pool, **kw)
    if isinstance(s, Exception):
        raise s
    return s


PRIME_TESTS = ["assert is_prime(7)", "assert not is_prime(4)", "assert is_prime(13)"]
PRIME_OK = "def is_prime(n):\n    return n > 1 and all(n % d for d in range(2, n))\n"

# A wrong solution plus a trick that made the old harness pass it (all of its cases).
ATTACKS = {
    "shadowed_bool": (PRIME_TESTS, """
        def is_prime(n):
            return int(n == 4)          # wrong everywhere
        def bool(x):                    # the old harness evaluated bool(is_prime(..)) here
            return not x
    """),
    "patched_builtins_bool": (PRIME_TESTS, """
        import builtins
        builtins.bool = lambda x: not x
        def is_prime(n):
            return int(n == 4)
    """),
    "patched_math_isclose": (["assert math.isclose(area(2.0), 12.566370614359172)"], """
        import math
        math.isclose = lambda *a, **k: True
        def area(r):
            return 0.0
    """),
    "patched_math_fabs": (["assert bool(math.fabs(half(5) - 2.5) < 1e-9)"], """
        import math
        math.fabs = lambda x: 0.0
        def half(x):
            return 0
    """),
    "patched_operator": (["assert operator.eq(sq(3), 9)", "assert operator.not_(sq(0))"], """
        import operator
        operator.eq = lambda a, b: True
        operator.not_ = lambda a: True
        def sq(x):
            return -1
    """),
    "forged_lines_early_exit": (PRIME_TESTS, """
        import os, sys
        f = sys._getframe(1)
        nonce = (f.f_locals.get("nonce") or f.f_globals.get("_NONCE") or "x") if f else "x"
        lines = "".join("%s %d value %s\\n%d pass \\n" % (nonce, i, v, i)
                        for i, v in enumerate([True, False, True]))
        for fd in (1, 2):
            try:
                os.write(fd, lines.encode())
            except OSError:
                pass
        for pid in (os.getppid(), 1):
            for fd in (1, 2):
                try:
                    with open("/proc/%d/fd/%d" % (pid, fd), "w") as out:
                        out.write(lines)
                except OSError:
                    pass
        os._exit(0)
    """),
    "eq_bool_hash_tricks": ([
        "assert f(1) == 2", "assert not g(4)", "assert h(3) in {9}", "assert f(2) == [2]",
        "assert s(1) == 'one'",
    ], """
        class Any:
            __eq__ = lambda self, other: True
            __ne__ = lambda self, other: False
            __hash__ = lambda self: 9 .__hash__()
            __bool__ = lambda self: False
        class I(int):
            __eq__ = lambda self, other: True
            __hash__ = lambda self: 9 .__hash__()
            __bool__ = lambda self: False
        class S(str):
            __eq__ = lambda self, other: True
        def f(x):
            return Any()
        def g(x):
            return I(7)                  # truthy 7 in fact: `not g(4)` must fail
        def h(x):
            return I(0)
        def s(x):
            return S("two")
    """),
    "redefined_prompt_helper": ({
        "prompt": "def is_pal(s):\n    return s == s[::-1]\n\n\ndef make_pal(s: str) -> str:\n"
                  "    \"\"\"Shortest palindrome starting with s.\"\"\"\n",
        "test": "def check(candidate):\n    assert is_pal(candidate('ab'))\n"
                "    assert candidate('ab').startswith('ab')\n",
        "entry_point": "make_pal",
    }, """
        def is_pal(s):
            return True
        def make_pal(s):
            return s + "x"
    """),
}


@pytest.mark.parametrize("name", sorted(ATTACKS))
def test_attack_scores_zero(pool, name):
    tests, code = ATTACKS[name]
    assert score(pool, code, tests) == 0.0, name


def test_honest_solutions_pass(pool):
    assert score(pool, PRIME_OK, PRIME_TESTS) == 1.0
    tests, _ = ATTACKS["redefined_prompt_helper"]
    ok = "    return s + s[:-1][::-1]\n"  # a HumanEval-style body completing the prompt
    assert score(pool, ok, tests, dedent=False) == 1.0
    assert score(pool, "import math\ndef area(r):\n    return math.pi * r * r\n",
                 ATTACKS["patched_math_isclose"][0]) == 1.0


MEMORY_SCAN = """
    import re
    def f():
        found = []
        with open("/proc/self/maps") as maps, open("/proc/self/mem", "rb") as mem:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if "r" not in line.split()[1] or hi - lo > 1 << 28:
                    continue
                try:
                    mem.seek(lo)
                    found += re.findall(rb"SECRET_[0-9]{9}", mem.read(hi - lo))
                except (OSError, ValueError, OverflowError):
                    pass
        return found[0].decode() if found else ""
    """


def test_test_data_is_not_in_the_candidates_memory(pool):
    """The candidate scans its whole address space for the expected value: absent."""
    code = MEMORY_SCAN
    tests = ["assert f() == 'SECRET_987654321'"]
    assert score(pool, code, tests, test_timeout_s=10) == 0.0
    # The scan itself works: it finds what the candidate's own source holds.
    own = textwrap.dedent(code).replace("def f():", "MINE = b'SECRET_123456789'\ndef f():")
    assert score(pool, own, ["assert f() == 'SECRET_123456789'"], test_timeout_s=10) == 1.0


def test_signals_to_the_judge_score_zero(pool):
    for sig in ("SIGTERM", "SIGINT", "SIGUSR1", "SIGKILL", "SIGSTOP"):
        code = f"""
            import os, signal
            def is_prime(n):
                os.kill(os.getppid(), signal.{sig})
                return int(n == 4)
        """
        assert score(pool, code, PRIME_TESTS, test_timeout_s=1) == 0.0, sig


def test_forged_reply_frame_with_colliding_set_is_bounded(pool):
    """The candidate writes its own reply frame: a huge set of ints that all hash alike. The
    judge (inside the sandbox) may choke on it; the trusted side returns within the job's
    deadline and scores 0."""
    code = """
        import json, os
        def f(x):
            m = (1 << 61) - 1
            wire = ["s", [k * m for k in range(1, 60000)]]
            data = json.dumps(["v", wire]).encode()
            os.write(5, len(data).to_bytes(4, "big") + data)
            import time
            time.sleep(30)
    """
    t0 = time.monotonic()
    assert score(pool, code, ["assert f(1) == {1}"], test_timeout_s=1) == 0.0
    assert time.monotonic() - t0 < 15


def test_exceptions_from_the_candidate(pool):
    """A raised exception reaches the test as a builtin exception (Python semantics: a test that
    expects ValueError passes); an exception class of the candidate's is CandidateError."""
    tests = ["try:\n    f(-1)\n    assert False\nexcept ValueError:\n    pass",
             "try:\n    g()\nexcept Exception as e:\n"
             "    assert type(e).__name__ == 'CandidateError'"]
    code = """
        class Mine(Exception):
            pass
        def f(x):
            raise ValueError("negative")
        def g():
            raise Mine()
    """
    assert score(pool, code, tests) == 1.0
    # SystemExit / KeyboardInterrupt inside the candidate's function are plain failures.
    code = "def f(x):\n    raise SystemExit(0)\ndef g():\n    raise KeyboardInterrupt\n"
    assert score(pool, code, tests) == 0.5  # the second test catches Exception: CandidateError


def test_python_semantics_in_comparisons(pool):
    code = "def f():\n    return [1]\ndef t():\n    return True\ndef n():\n    return None\n"
    tests = ["assert f() != (1,)", "assert t() == 1", "assert n() is None", "assert t() is True",
             "assert f() is not f()"]
    assert score(pool, code, tests) == 1.0
    assert score(pool, code, ["assert f() == (1,)"]) == 0.0


# --- several completions in one judge job (the fork-server path) --------------------------------

SQ_TESTS = ["assert sq(3) == 9", "assert sq(-2) == 4"]
SQ_OK, SQ_BAD = "def sq(x):\n    return x * x\n", "def sq(x):\n    return x + x\n"


class _Counting:
    """Records the number of jobs of every `run` call."""

    def __init__(self, pool):
        self.pool, self.calls = pool, []

    def run(self, jobs):
        self.calls.append(len(jobs))
        return self.pool.run(jobs)


def _batch(pool, pairs, calls=None, **kw):
    """Scores (completion, tests) pairs with up to 16 per judge job; `calls`: the allowed lists
    of `pool.run` sizes."""
    items = [{"completion": textwrap.dedent(c), "tests": t} for c, t in pairs]
    counting = _Counting(pool)
    out = code_tests_batch(items, pool=counting, items_per_job=16, **kw)
    if calls is not None:
        assert counting.calls in calls
    return out


def test_attacks_in_one_job_with_honest_neighbours(pool):
    """Every attack shares a job with right and wrong solutions of other problems: the attacks
    score 0, the neighbours what they earn."""
    pairs, want = [], []
    for i, name in enumerate(sorted(ATTACKS)):
        tests, code = ATTACKS[name]
        neighbour = [f"assert sq({n}) == {n * n}" for n in (i + 3, i + 4)]
        ok = i % 2 == 0
        pairs += [(code, tests), (SQ_OK if ok else SQ_BAD, neighbour)]
        want += [0.0, 1.0 if ok else 0.0]
    assert _batch(pool, pairs) == want


KILL_JUDGE = """
    import os, signal
    def judge_pid():
        with open("/proc/%d/stat" % os.getppid()) as f:   # our parent is the fork server
            return int(f.read().rsplit(")", 1)[1].split()[1])
    def sq(x):
        for pid in (judge_pid(), os.getppid()):
            os.kill(pid, signal.SIGKILL)
        return x * x
"""

DAEMON = """
    import os, time
    def sq(x):
        me = os.getpid()
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:           # a grandchild in its own session, outliving us
                while True:              # waits until our process is gone (the next item runs)
                    try:
                        os.kill(me, 0)
                    except ProcessLookupError:
                        break
                    time.sleep(0.005)
                time.sleep(0.1)
                for _ in range(300):     # then kills everything this uid can signal
                    try:
                        os.kill(-1, 9)
                    except OSError:
                        pass
                    time.sleep(0.01)
            os._exit(0)
        return x + x
"""
SLOW_SQ = "def sq(x):\n    import time\n    time.sleep(0.4)\n    return x * x\n"

REACH_OTHERS = """
    import os, struct
    hits = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:                                  # inject into the fork server / the judge
            with open("/proc/%s/mem" % name, "r+b") as f:
                hits.append(("mem", name))
        except OSError:
            pass
        try:
            for fd in os.listdir("/proc/%s/fd" % name):
                try:
                    w = os.open("/proc/%s/fd/%s" % (name, fd), os.O_WRONLY | os.O_NONBLOCK)
                    frame = b'["v", 9]'
                    os.write(w, struct.pack(">I", len(frame)) + frame)
                    os.write(w, b"0 0 pass \\n1 0 pass \\n2 0 pass \\n")
                    hits.append(("fd", name, fd))
                except OSError:
                    pass
        except OSError:
            pass
    def sq(x):
        return len(hits) * 1000 + 2   # wrong either way
"""


def test_a_candidate_that_kills_the_judge_hurts_only_itself(pool):
    pairs = [(SQ_OK, SQ_TESTS), (KILL_JUDGE, ["assert sq(2) == 4", "assert sq(1) == 1"]),
             (SQ_OK, ["assert sq(5) == 25"]), (SQ_BAD, ["assert sq(4) == 16"]),
             (SQ_OK, ["assert sq(6) == 36"])]
    # Where it can find and kill the judge (tier A), the items after it are rerun alone.
    out = _batch(pool, pairs, calls=([1], [1, 3]), test_timeout_s=2)
    assert out[0] == 1.0 and out[2:] == [1.0, 0.0, 1.0]
    assert out[1] <= 0.5  # its first call may have answered before the judge died


def test_a_leftover_daemon_cannot_reach_the_next_items(pool):
    pairs = [(DAEMON, ["assert sq(3) == 9"]), (SLOW_SQ, ["assert sq(7) == 49"]),
             (SLOW_SQ, ["assert sq(8) == 64", "assert sq(9) == 81"])]
    t0 = time.monotonic()
    out = _batch(pool, pairs, calls=([1],), test_timeout_s=2)  # swept before it fired
    assert out == [0.0, 1.0, 1.0]
    assert time.monotonic() - t0 < 20


def test_no_candidate_can_write_into_the_server_judge_or_verdicts(pool):
    pairs = [(REACH_OTHERS, ["assert sq(1) == 1"]), (SQ_BAD, ["assert sq(3) == 9"]),
             (SQ_BAD, ["assert sq(4) == 16"])]
    assert _batch(pool, pairs, calls=([1],)) == [0.0, 0.0, 0.0]


def test_neighbours_test_data_is_not_in_a_candidates_memory(pool):
    pairs = [(SQ_OK, ["assert sq(3) == 9", "assert 'SECRET_555444333'"]),
             (MEMORY_SCAN, ["assert f() == 'SECRET_987654321'"]),
             (SQ_OK, ["assert sq(2) == 4 and 'SECRET_111222333'"])]
    assert _batch(pool, pairs, test_timeout_s=10) == [1.0, 0.0, 1.0]


def test_a_sandbox_that_cannot_start_python_is_an_error_not_a_zero(pool, monkeypatch):
    from jaxrl.rewards.code import harness as code_harness

    broken = code_harness.JUDGE_SRC.replace("self.exe = sys.executable",
                                            "self.exe = '/nonexistent/python'")
    assert broken != code_harness.JUDGE_SRC
    monkeypatch.setattr(code_harness, "JUDGE_SRC", broken)
    monkeypatch.setattr(code_harness, "_judge_code", None)
    out = code_tests_batch([{"completion": SQ_OK, "tests": SQ_TESTS},
                            {"completion": SQ_OK, "tests": ["assert sq(5) == 25"]}], pool=pool)
    assert all(isinstance(o, RuntimeError) and "did not start" in str(o) or
               "cannot start" in str(o) for o in out), out
    monkeypatch.undo()
    code_harness._judge_code = None
    assert code_tests_batch([{"completion": SQ_OK, "tests": SQ_TESTS}], pool=pool) == [1.0]
