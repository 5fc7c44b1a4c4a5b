"""`--resume`: the config a run continues with, and a checkpoint that does not fit it.

    cfg, changed = resume_config(load_config(path), overrides)

The run's saved config.json is the base and the flags given now apply on top, so
`python launch/run.py --name=x --resume` continues run x as it was started, and
`--name=x --resume --pipeline.steps=100` extends it. `--config FILE` (or the default experiment)
only locates the run (with `--name` / `--run_dir`) and registers whatever tasks and rewards the
file defines; its values do not replace the saved ones. A run directory without config.json
resumes with `base` plus the flags, as before.

When the checkpoint's shapes still differ from the config (`--model.hidden_size=...` given
now, another `--init`), `restore_error` names the keys that differ from the saved config rather
than blaming the files. No JAX imports.
"""

from __future__ import annotations

from pathlib import Path

from jaxrl.config.base import ConfigError
from jaxrl.config.data import task_names
from jaxrl.config.overrides import apply_overrides, split_overrides, to_dict
from jaxrl.config.readback import differences, read_config
from jaxrl.config.run import RunConfig

LOCATING = ("name", "run_dir")  # the keys that say which run directory to resume
# keys whose values decide what a checkpoint holds (the parameters, the optimiser state, a LoRA
# run's base)
SHAPING = ("init", "model.", "train.", "seed")


def resume_config(base: RunConfig, overrides: list[str]) -> tuple[RunConfig, list[str]]:
    """(the config to resume with, the saved keys the flags changed, as `key: old -> new`).

    `base` is the experiment file's config without the flags; the flags' `--name` / `--run_dir`
    locate the run. See the module docstring."""
    pairs = split_overrides(base, list(overrides))
    located = apply_overrides(base, [f"--{k}={v}" for k, v in pairs if k in LOCATING])
    saved_file = located.path / "config.json"
    if not saved_file.is_file():
        return apply_overrides(base, overrides), []
    try:
        saved = read_config(saved_file, any_task=False)
    except ConfigError as e:
        if "data.task" in str(e):
            raise ConfigError(
                f"{e}\n(the run was started with a task this process has not registered, "
                f"e.g. by jaxrl.api.train or an experiment file's register_task: pass that "
                f"file with --config; registered here: {task_names()})") from None
        raise
    cfg = apply_overrides(saved, overrides)
    return cfg, differences(to_dict(saved), to_dict(cfg))


def restore_error(recorded: RunConfig, run_dir: str | Path, error: Exception) -> Exception:
    """The error to raise when no checkpoint of `run_dir` loads into the run built from
    `recorded` (the config as config.json records it: the `--init` model's shape in `model`).
    When the saved config differs in keys that shape the checkpoint, a `ConfigError` naming
    them; otherwise `error` itself (the files are the problem)."""
    saved_file = Path(run_dir) / "config.json"
    if not saved_file.is_file():
        return error
    try:
        saved = read_config(saved_file)
    except ConfigError:
        return error
    diff = differences(to_dict(saved), to_dict(recorded))
    shaping = [d for d in diff if d.startswith(SHAPING)]
    if not shaping:
        return error
    return ConfigError(
        f"the checkpoints in {run_dir} do not fit this run's model: its config differs from the "
        f"run's saved config.json in keys that decide what a checkpoint holds: "
        f"{'; '.join(shaping)}. Resume without changing those keys "
        f"(python launch/run.py --name={recorded.name} --resume uses the saved config), or "
        f"start a new run with another --name. (restore said: {_detail(error)})")


def _detail(error: Exception) -> str:
    """Why each checkpoint did not load (`NoUsableCheckpoint.skipped`), else the first line."""
    skipped = getattr(error, "skipped", None)
    text = ("; ".join(f"step {s}: {r}" for s, r in skipped) if skipped
            else (str(error).splitlines() or [type(error).__name__])[0])
    return text if len(text) <= 400 else text[:397] + "..."
