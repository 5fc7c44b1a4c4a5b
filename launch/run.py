"""Run an experiment: `python launch/run.py [--config configs/<name>.py] [--a.b=c ...] [--resume]`.

With no arguments it runs the default experiment (configs/default.py) on the devices it finds.
"""

import argparse
import logging
import os
import sys
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
        return 2
    except KeyboardInterrupt:
        print("interrupted: stopped cleanly; continue with --resume", file=sys.stderr)
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
