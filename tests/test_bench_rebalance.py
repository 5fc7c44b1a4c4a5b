"""`python launch/bench.py rebalance`: its arguments are checked before any run (and before JAX
is imported), and its figures from metrics rows are checked by hand. A full run of both policies
takes minutes on CPU (docs/benchmarks.md records one); tests/rl/test_rebalance_auto.py
runs `auto` against a slow generator end to end."""

import subprocess
import sys
from pathlib import Path

import pytest

from jaxrl.benchmarks.rebalance import figures

ROOT = Path(__file__).resolve().parents[1]


@pytest.mark.parametrize("argv, message", [
    (["--start", "6-2"], "--start must be T:G"),
    (["--start", "0:8"], "--start must be T:G"),
    (["--mode", "eager"], "valid: \\['sync'"),
    (["--delay", "-1"], "--delay must be"),
    (["--steps", "2", "--warmup", "2"], "--warmup < --steps"),
    (["--confirm", "0"], "--confirm >= 1"),
])
def test_bad_arguments_are_refused_before_any_run(argv, message):
    from jaxrl.benchmarks import rebalance

    with pytest.raises(SystemExit, match=message):
        rebalance.main(argv)


def test_the_cli_answers_a_bad_split_without_importing_jax():
    code = ("import sys; sys.argv[1:] = ['rebalance', '--start', 'x']; "
            "sys.path.insert(0, 'launch'); import bench\n"
            "try:\n    bench.main(sys.argv[1:])\nexcept SystemExit as e:\n"
            "    print(e, 'jax' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True,
                         timeout=60)
    assert out.stdout.strip() == "--start must be T:G with whole numbers >= 1 (e.g. 6:2), got " \
                                 "'x' False", out.stderr


def _row(step, step_s, idle, chips, **extra):
    return {"step": step, "pipeline/step_s": step_s, "pipeline/trainer_idle_frac": idle,
            "pipeline/rollouts_per_s_produced": 10.0 * (8 - chips),
            "pipeline/trainer_chips": chips, "pipeline/generator_chips": 8 - chips, **extra}


def test_figures_count_the_moves_pause_and_pair_each_move_with_its_measurement():
    move = {"rebalance/from_trainer_chips": 6.0, "rebalance/to_trainer_chips": 2.0,
            "rebalance/current_samples_per_s": 10.0, "rebalance/predicted_samples_per_s": 30.0,
            "rebalance/move_s": 3.0}
    measured = {"rebalance/measured_samples_per_s": 32.0, "rebalance/recompile_s": 5.0,
                "rebalance/measured_cost_s": 8.0}
    history = [_row(0, 60.0, 0.5, 6), _row(1, 2.0, 0.9, 6, **move), _row(2, 4.0, 0.1, 2),
               _row(3, 0.5, 0.6, 2, **measured)]
    f = figures(history, warmup=1, batch=16)  # rows without a clock: windows + pauses
    assert f["timed_s"] == f["windows_s"] == 2.0 + 3.0 + 4.0 + 0.5  # step 0 left out
    assert f["samples_per_s"] == 16 * 3 / 9.5
    assert f["trainer_idle"] == pytest.approx((0.9 + 0.1 + 0.6) / 3)
    assert f["final_split"] == [2, 6]
    assert f["moves"] == [{"from_trainer_chips": 6.0, "to_trainer_chips": 2.0,
                           "current_samples_per_s": 10.0, "predicted_samples_per_s": 30.0,
                           "move_s": 3.0, "after_step": 1, "measured_samples_per_s": 32.0,
                           "recompile_s": 5.0, "measured_cost_s": 8.0, "at_step": 3}]
    # before: the timed steps up to the move; after: from its measured step on (settling left out)
    assert f["before"] == {"trainer_idle": 0.9, "produced_per_s": 20.0,
                           "samples_per_s": 16 / 2.0, "steps": [1]}
    assert f["after"] == {"trainer_idle": 0.6, "produced_per_s": 60.0,
                          "samples_per_s": 16 / 0.5, "steps": [3]}


def test_figures_time_the_run_by_the_rows_clock_from_the_last_warm_up_row():
    # the time between the windows (hooks, the policy, the move) counts too
    history = [_row(0, 60.0, 0.5, 6, time=100.0), _row(1, 2.0, 0.9, 6, time=102.5),
               _row(2, 4.0, 0.1, 6, time=107.0), _row(3, 0.5, 0.6, 6, time=108.0)]
    f = figures(history, warmup=1, batch=16)
    assert f["timed_s"] == 8.0 and f["windows_s"] == 6.5
    assert f["samples_per_s"] == 16 * 3 / 8.0
    assert figures(history, warmup=0, batch=16)["timed_s"] == 66.5  # no row before: windows
