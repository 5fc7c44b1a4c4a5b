"""Benchmarks behind `python launch/bench.py <name>`: one module per name with `main(argv)`."""

import importlib.util

# What the comparisons with `transformers`-based peers need in the driver's own environment
# (it writes the shared weights with them, and pins the peers' venvs to its transformers): the
# `bench` extra installs them.
PEER_PACKAGES = ("torch", "transformers")


def missing_packages(what: str, packages=PEER_PACKAGES) -> str | None:
    """None when every one of `packages` is importable here (looked up, not imported), else the
    error to print: what needs them, which are missing and the command that installs them."""
    missing = [p for p in packages if importlib.util.find_spec(p) is None]
    if not missing:
        return None
    return (f"{what} needs {' and '.join(packages)} in this environment; missing: "
            f"{', '.join(missing)}. Install them with: pip install -e '.[bench]'")
