"""Progress you can trust: one display per phase (SFT, evaluation, RL), ETAs without the compile,
console steps numbered as metrics.jsonl, the before-RL evaluation at step 0, samples and the run
config in TensorBoard, a true message when a finished run is resumed."""

from __future__ import annotations

import io
import json
import logging
import re
import struct
import time
import types
from pathlib import Path

import pytest

from jaxrl.rl.metrics import MetricsLogger, read_metrics


@pytest.fixture
def clock(monkeypatch):
    """A fake `time.perf_counter` the test advances (seconds)."""
    now = [0.0]
    monkeypatch.setattr(time, "perf_counter", lambda: now[0])
    return now


def _tb_events(run_dir: Path) -> list:
    """Every Event in the TensorBoard files, read from the TFRecord framing by hand (length,
    crc, payload, crc), so the check does not rely on the writer's own reader."""
    from tensorboardX.proto import event_pb2

    events = []
    for path in sorted((run_dir / "tb").glob("events.out.tfevents.*")):
        data = path.read_bytes()
        i = 0
        while i < len(data):
            (n,) = struct.unpack("<Q", data[i:i + 8])
            events.append(event_pb2.Event.FromString(data[i + 12:i + 12 + n]))
            i += 12 + n + 4
    return events


def _texts(run_dir: Path) -> dict[str, list[tuple[int, str]]]:
    out: dict[str, list] = {}
    for e in _tb_events(run_dir):
        for v in e.summary.value:
            if v.metadata.plugin_data.plugin_name == "text":
                text = b"".join(v.tensor.string_val).decode()
                out.setdefault(v.tag, []).append((e.step, text))
    return out


def test_eta_leaves_out_the_first_compiling_step(tmp_path, clock):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=10, tensorboard=False, stream=out)
    clock[0] = 100.0  # step 0 took 100 s (compilation)
    logger.log(0, {"reward/mean": 0.5})
    clock[0] = 101.0  # then 1 s per step
    logger.log(1, {"reward/mean": 0.5})
    clock[0] = 102.0
    logger.log(2, {"reward/mean": 0.5})
    logger.close()
    lines = out.getvalue().strip().splitlines()
    assert lines[-1].endswith("ETA 7s"), lines  # 7 steps left at 1 s each
    assert lines[0].endswith("ETA -"), lines  # no rate yet after the compiling step


def test_console_steps_are_the_metrics_jsonl_steps(tmp_path, clock):
    out = io.StringIO()
    logger = MetricsLogger(tmp_path, total_steps=5, tensorboard=False, stream=out)
    for step in range(3):
        clock[0] += 1.0
        logger.log(step, {"reward/mean": 0.1 * step, "loss/total": 1.0})
    logger.close()
    resumed = MetricsLogger(tmp_path, total_steps=5, tensorboard=False, stream=out)
    for step in (3, 4):
        clock[0] += 1.0
        resumed.log(step, {"reward/mean": 0.0})
    resumed.close()
    console = [int(m) for m in re.findall(r"\bstep (\d+)\b", out.getvalue())]
    assert console == [r["step"] for r in read_metrics(tmp_path)] == [0, 1, 2, 3, 4]
    assert "RL 4/5 | step 3 " in out.getvalue()  # steps done counted beside the step number


def test_resume_of_a_finished_run_says_it_is_complete(tmp_path):
    first = MetricsLogger(tmp_path / "r", total_steps=3, tensorboard=False, progress=False)
    for step in range(3):
        first.log(step, {"reward/mean": 1.0})
    first.close()
    again = MetricsLogger(tmp_path / "r", total_steps=3, tensorboard=False, progress=False)
    summary = again.summary()
    again.close()
    assert summary == "run r is complete at step 2 (3 steps); nothing to do"


def test_samples_and_config_go_to_tensorboard_and_samples_jsonl(tmp_path):
    logger = MetricsLogger(tmp_path, total_steps=20, progress=False)
    logger.log_config({"name": "t", "pipeline": {"steps": 20}})
    sample = {"prompt": "def f(x):", "completion": "return x + 1", "reward": 0.75}
    for step in range(20):
        logger.log_samples(step, [sample, {**sample, "reward": 0.0}], every=10)
    logger.close()
    rows = [json.loads(x) for x in (tmp_path / "samples.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [9, 9, 19, 19]  # every 10th step, as the rows count
    assert rows[0] == {"step": 9, **sample}
    texts = _texts(tmp_path)
    (config_step, config), = texts["config/text_summary"]
    assert config_step == 0 and json.loads(config.strip("`\n")) == {"name": "t",
                                                                   "pipeline": {"steps": 20}}
    assert [s for s, _ in texts["samples/text_summary"]] == [9, 19]
    assert "return x + 1" in texts["samples/text_summary"][0][1]


def test_evaluation_shows_progress():
    from jaxrl.config import DataConfig
    from jaxrl.rl.evaluator import Evaluator

    class Producer:
        def evaluate(self, scheduler, records, *, pass_k, temperature, seed, index_offset,
                     on_sample=None):
            for _ in range(len(records) * (pass_k + 1)):
                on_sample(1)
            return {"eval/pass@1": 0.5}

    class Task:
        def eval_records(self, n):
            return [{"i": i} for i in range(n)]

    class OneProcess:
        leader = True

        def eval_share(self, n):
            return 0, n

        def combine_evals(self, n, metrics):
            return metrics

    stream = io.StringIO()
    import jaxrl.progress as progress

    real = progress.Progress

    def to_stream(*a, **k):
        return real(*a, **{**k, "stream": stream})

    progress_cls = pytest.MonkeyPatch()
    progress_cls.setattr("jaxrl.rl.evaluator.Progress", to_stream, raising=False)
    try:
        cfg = DataConfig(eval_size=3, pass_k=2)
        generator = types.SimpleNamespace(scheduler=None)  # before the loop runs: inline
        metrics = Evaluator(Producer(), Task(), cfg, OneProcess(), seed=0)(
            0, on_generator=lambda fn: fn(generator, None))
    finally:
        progress_cls.undo()
    assert metrics == {"eval/pass@1": 0.5}
    # the first sample at once (the phase is not silent), then at most every 10 s, and the end:
    # 3 prompts x (pass_k 2 + greedy)
    assert stream.getvalue().splitlines() == [
        "eval@0 0/9 | started (the first sample includes compilation)",
        "eval@0 1/9 | ETA -", "eval@0 9/9 | ETA 0s"]


def test_plain_progress_lines_and_quiet(monkeypatch):
    from jaxrl import progress

    out = io.StringIO()
    bar = progress.Progress("SFT", 4, stream=out)
    bar.update(1, step=1, loss=2.0)
    bar.update(3, step=4, loss=1.0)
    assert out.getvalue().splitlines() == ["SFT 1/4 | step 1 | loss 2 | ETA -",
                                           "SFT 4/4 | step 4 | loss 1 | ETA 0s"]
    monkeypatch.setattr(progress, "_ENABLED", [False])
    quiet = io.StringIO()
    progress.Progress("SFT", 2, stream=quiet).update(2)
    assert quiet.getvalue() == ""


def test_sft_prints_one_line_per_logged_step(tmp_path, capsys, caplog):
    """SFT printed each logged step twice (the run's on_log and run_sft's own log line)."""
    from run_helpers import tiny_run_config

    from jaxrl.config import SFTConfig
    from jaxrl.data.tasks import build_task
    from jaxrl.rl.processes import Processes
    from jaxrl.tokenizers import load_tokenizer
    from jaxrl.train import init as build

    cfg = tiny_run_config(tmp_path, data=dict(sft=SFTConfig(
        steps=4, batch_size=4, log_every=2, cache=False, cache_dir=str(tmp_path / "c"))))
    processes = Processes(cfg)
    meshes = processes.meshes(cfg.mesh)
    tokenizer = load_tokenizer("char")  # the tiny run's
    task = build_task(cfg.data)
    model_cfg = build.model_config(cfg, tokenizer)
    with caplog.at_level(logging.INFO):
        build.initial_params(cfg, meshes.trainer, tokenizer, task, model_cfg, processes)
    logged = [r.getMessage() for r in caplog.records if "sft step" in r.getMessage().lower()]
    err = capsys.readouterr().err.splitlines()
    assert err[0].startswith("SFT 0/4 | started")  # at once, before the compiling first step
    shown = [ln for ln in err if re.match(r"SFT \d+/4 \| step", ln)]
    assert len(logged) + len(shown) == 3, (logged, shown)  # steps 1, 2 and 4: once each
    assert [int(re.search(r"step (\d+)", ln).group(1)) for ln in shown] == [1, 2, 4]


# The before-RL evaluation at step 0, samples, the config in TensorBoard and the console steps of a
# whole run: tests/rl/test_run_defects.py::test_a_run_logs_the_before_rl_evaluation_at_step_0_and_
# samples (on that file's shared run).


def test_terminal_gets_one_tqdm_bar_with_the_same_eta(clock):
    from jaxrl.progress import Progress

    class Terminal(io.StringIO):
        def isatty(self):
            return True

    term = Terminal()
    bar = Progress("RL", 10, stream=term)
    clock[0] = 100.0
    bar.update(1, step=0)
    clock[0] = 102.0
    bar.update(1, step=1)
    bar.close()
    screen = term.getvalue().split("\r")[-1]  # what the terminal shows last
    assert screen.startswith("RL 2/10 |") and "step 1 | ETA 16s" in screen, repr(screen)
    assert "\n" not in term.getvalue().rstrip("\n")  # redrawn in place, not a line per update
