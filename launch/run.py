"""Run an experiment: `python launch/run.py [--config configs/<name>.py] [--a.b=c ...] [--resume]`.

`--resume` continues the run `--name` names with its saved config.json, the flags given now
applied on top (`jaxrl.config.resume`); `--config` then only locates it and registers its tasks.

`--help` lists every config key with its value and description; `--print-config` prints the
resolved config. Overrides are `--a.b=c` or `--a.b c`; the config is checked before JAX starts.

With no arguments it runs the default experiment (configs/default.py) on the devices it finds.
Several processes (TPU pod, GPU cluster, `launch/local_cluster.py`) each run this same command;
`jax.distributed` starts from the environment or `--dist.coordinator=host:port
--dist.num_processes=N --dist.process_id=i` (docs/scale.md). A process that fails exits at once
(no waiting on peers that may be gone), which makes the others fail fast too.
"""

import logging
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "configs" / "default.py"


def main(argv: list[str]) -> int:
    # The config is parsed and validated before JAX (or anything heavy) is imported, so a wrong
    # flag or value fails at once; jaxrl.config imports no JAX.
    from jaxrl.config import ConfigError, load_config
    from jaxrl.config.cli import config_json, help_text, parse_args

    try:
        args = parse_args(argv)
        path = args.config or str(DEFAULT)
        if args.help:
            print(help_text(load_config(path), args.config or "configs/default.py"))
            return 0
        changed = None
        if args.resume:  # the run's saved config.json, the flags given now on top
            from jaxrl.config.resume import resume_config

            cfg, changed = resume_config(load_config(path), args.overrides)
        else:
            cfg = load_config(path, args.overrides)
    except ConfigError as e:
        print(f"error: {e}\n(python launch/run.py --help lists every key)", file=sys.stderr)
        return 2
    if args.print_config:
        print(config_json(cfg))
        return 0
    try:
        from jaxrl.train.run_dir import check_writable  # no JAX

        check_writable(cfg.run_dir)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and "XLA_FLAGS" not in os.environ:
        # On a CPU-only machine, split the cores into devices so trainer and generator get
        # their own meshes (set before JAX starts).
        from jaxrl.cpu import simulated_device_flags

        os.environ["XLA_FLAGS"] = simulated_device_flags()
    if changed is not None:
        logging.getLogger("jaxrl").info(
            "--resume: %s's saved config.json%s", cfg.path,
            f", with the flags given now: {'; '.join(changed)}" if changed else " as it was")
    from jaxrl import progress

    progress.set_enabled(not args.quiet)
    import jaxrl.run
    from jaxrl.data.sources import RecordError
    from jaxrl.rl.stopping import Terminated

    stop_on_sigterm()
    try:
        jaxrl.run.run(cfg, resume=args.resume, progress=not args.quiet)
    except (ConfigError, RecordError) as e:  # checks that need the devices or the data
        print(f"error: {e}", file=sys.stderr)
        return _leave(2)
    except Terminated as e:
        detail = str(e) or "the last checkpoint kept"
        print(f"terminated (SIGTERM): stopped cleanly, {detail}; continue with --resume",
              file=sys.stderr)
        return _leave(143)
    except KeyboardInterrupt as e:
        detail = str(e) or "the last checkpoint kept"
        print(f"interrupted: stopped cleanly, {detail}; continue with --resume", file=sys.stderr)
        return _leave(130)
    except Exception:
        if _multi_process():
            traceback.print_exc()
            _leave(1)
        raise
    return 0


def stop_on_sigterm() -> None:
    """Before the run (which handles signals itself, jaxrl/rl/stopping.py): SIGTERM stops
    like Ctrl-C (exit 143); a second SIGTERM exits at once."""
    import signal

    def first(signum, frame):
        signal.signal(signal.SIGTERM, lambda *_: os._exit(143))
        from jaxrl.rl.stopping import Terminated

        raise Terminated()

    signal.signal(signal.SIGTERM, first)


def _multi_process() -> bool:
    import jax

    from jaxrl import distributed

    return distributed.initialized() and jax.process_count() > 1


def _leave(code: int) -> int:
    """Several processes: exit now, skipping the distributed shutdown barrier, which would wait
    for (or abort on) peers that failed too."""
    if _multi_process():
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
