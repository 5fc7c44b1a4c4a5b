"""The controller scores rollouts on Ray: a local Ray head with 2 CPUs started by the test."""

import pytest

ray = pytest.importorskip("ray", reason="the `ray` extra is not installed")

from run_helpers import tiny_run_config  # noqa: E402

import jaxrl.run  # noqa: E402
from jaxrl.rl.metrics import read_metrics  # noqa: E402


@pytest.fixture
def ray_head():
    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    try:
        yield
    finally:
        ray.shutdown()


@pytest.mark.slow
def test_controller_run_with_ray_sandbox_hosts(tmp_path, ray_head):
    cfg = tiny_run_config(tmp_path, name="ray", pipeline=dict(steps=2),
                          rewards=dict(backend="ray"))
    result = jaxrl.run.run(cfg, progress=False)
    rows = read_metrics(result.run_dir)
    assert [r["step"] for r in rows] == [0, 1]
    # Every completion was scored on the Ray actors (pysynth runs candidates in the sandbox).
    assert rows[-1]["reward/items_scored"] >= 2 * 4 * 4
    assert rows[-1]["sandbox/exec_s_p50"] > 0
    assert "ray" in (result.run_dir / "config.json").read_text()
    # The pool released its actors; the cluster the test started is still up.
    assert ray.is_initialized()
    assert not [a for a in ray.util.list_named_actors(all_namespaces=True)]
