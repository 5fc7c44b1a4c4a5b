"""Run an experiment: `python launch/run.py [--config configs/<name>.py] [--a.b=c ...] [--resume]`.

With no arguments it runs the default experiment (configs/default.py) on the devices it finds.
Several processes (TPU pod, GPU cluster, `launch/local_cluster.py`) each run this same command;
`jax.distributed` starts from the environment or `--dist.coordinator=host:port
--dist.num_processes=N --dist.process_id=i` (docs/scale.md). A process that fails exits at once
(no waiting on peers that may be gone), which makes the others fail fast too.
"""

import argparse
import logging
import os
import sys
import traceback
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DEFAULT = ROOT / "configs" / "default.py"


def main(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(description=__doc__, allow_abbrev=False)
    parser.add_argument("--config", default=str(DEFAULT), help="experiment file (configs/*.py)")
    parser.add_argument("--resume", action="store_true", help="continue the run's checkpoint")
    parser.add_argument("--quiet", action="store_true", help="no progress line")
    args, overrides = parser.parse_known_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    for noisy in ("absl", "jax", "orbax"):
        logging.getLogger(noisy).setLevel(logging.WARNING)
    if os.environ.get("JAX_PLATFORMS", "") in ("", "cpu") and "XLA_FLAGS" not in os.environ:
        # On a CPU-only machine, split the cores into devices so trainer and generator get
        # their own meshes (set before JAX starts).
        from jaxrl.cpu import simulated_device_flags

        os.environ["XLA_FLAGS"] = simulated_device_flags()
    import jaxrl.run
    from jaxrl.config import ConfigError, load_config

    try:
        cfg = load_config(args.config, overrides)
        jaxrl.run.run(cfg, resume=args.resume, progress=not args.quiet)
    except ConfigError as e:
        print(f"error: {e}", file=sys.stderr)
        return _leave(2)
    except KeyboardInterrupt:
        print("interrupted: stopped cleanly; continue with --resume", file=sys.stderr)
        return _leave(130)
    except Exception:
        if _multi_process():
            traceback.print_exc()
            _leave(1)
        raise
    return 0


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
