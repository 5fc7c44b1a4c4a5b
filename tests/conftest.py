"""Test session set-up: a simulated 8-device CPU mesh, set once before JAX starts."""

import os
import tempfile

os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()
os.environ.setdefault("JAX_PLATFORMS", "cpu")
# XLA's persistent compilation cache, shared by the test processes (pytest-xdist's workers and the
# runs that tests launch as subprocesses, which inherit this environment): many tests compile the
# same tiny-model programs (a SIGKILL test launches the same run three times), and on two cores
# compiling is much of the suite's time. Keyed by the program and the compile options, so an entry
# is only ever reused for an identical program; the size limit turns on jax's file lock, which
# keeps concurrent readers from seeing a half-written entry.
os.environ.setdefault("JAX_COMPILATION_CACHE_DIR", os.path.join(
    tempfile.gettempdir(), f"jaxrl-test-xla-cache-{os.getuid()}"))
os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0.2")
os.environ.setdefault("JAX_COMPILATION_CACHE_MAX_SIZE", str(4 * 2**30))

import jax  # noqa: E402

jax.config.update("jax_numpy_rank_promotion", "raise")
jax.config.update("jax_default_matmul_precision", "highest")

import warnings  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from jaxrl.sandbox.plan import UID_BASE_ENV, default_uid_base  # noqa: E402

_START = Path.cwd()
_UID_BASE = default_uid_base()  # before a worker moves it: the controlling process's value


def pytest_configure(config):
    """xdist hands out whole files in collection order (the longest first, below). Sandbox
    slot uids are leased machine-wide, and tests check that no process of a closed
    pool's uids is left. With one uid range for all xdist workers, another worker's pool could
    lease a uid the moment it is released and run jobs as it (a CI run failed so). Each worker
    gets its own range (the worker id is known from here on, not when this file is imported);
    the runs and Ray workers its tests start inherit it."""
    if hasattr(config.option, "loadscopereorder"):  # xdist: hand out files in collection order
        config.option.loadscopereorder = False  # (the longest first: see below)
    worker = getattr(config, "workerinput", {}).get("workerid", "").removeprefix("gw")
    if worker.isdigit():  # an xdist worker (its environment came from the controlling process)
        os.environ[UID_BASE_ENV] = str(_UID_BASE + 8192 * int(worker))


@pytest.fixture(autouse=True)
def _working_directory_survives(request):
    """In one full-suite run the session's working directory was gone or elsewhere
    (`os.getcwd()` raised FileNotFoundError, relative paths such as configs/default.py were not
    found) from some test on, and every later test that used it failed. After each test: if it
    moved or is gone, go back to where the session started and say after which test (a
    warning: pytest shows it in the summary)."""
    yield
    try:
        here = Path.cwd()
    except FileNotFoundError:
        here = None
    if here != _START:
        os.chdir(_START)
        warnings.warn(f"working directory {'gone' if here is None else here} after "
                      f"{request.node.nodeid}; back to {_START}", stacklevel=1)



# --- the suite's budget (tests/suite_budget.py, docs/testing.md) --------------------------------
def pytest_collection_modifyitems(session, config, items):
    """The longest files first (suite_budget.LONG_FILES); xdist's controller keeps this order
    (pytest_configure turns off its default reordering of files by their number of tests)."""
    from suite_budget import long_files_first

    items[:] = [items[i] for i in long_files_first([item.nodeid for item in items])]


_durations: dict[str, float] = {}


def pytest_runtest_logreport(report):
    _durations[report.nodeid] = _durations.get(report.nodeid, 0.0) + report.duration


def pytest_sessionfinish(session, exitstatus):
    from suite_budget import WHOLE_RUNS_ALLOWED, budget_problems, whole_runs

    if hasattr(session.config, "workerinput") or exitstatus != 0 or not _durations:
        return  # an xdist worker, or a failed / partial run
    if session.config.option.keyword or session.config.option.markexpr or \
            len(_durations) < 1000:
        return  # a selection of tests, not the whole suite
    runs = whole_runs(session.config._tmp_path_factory.getbasetemp())
    workers = getattr(session.config.option, "numprocesses", None) or 1
    problems = budget_problems(_durations, len(runs), load=os.getloadavg()[0],
                               workers=int(workers), cores=os.cpu_count() or 1)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"suite budget: slowest test {max(_durations.values()):.0f} s, "
                            f"{len(runs)} whole-system runs (allowed {WHOLE_RUNS_ALLOWED})")
        for problem in problems:
            reporter.write_line(f"suite budget exceeded: {problem}", red=True)
    if problems:
        session.exitstatus = pytest.ExitCode.TESTS_FAILED
