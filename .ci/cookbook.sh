#!/usr/bin/env bash
# tinker-cookbook 0.6.1's recipes (rl_loop, math_rl sync and async, a resume, chat_sl's rolling
# checkpoints) against the service:
# tests/service/test_cookbook_recipes.py with the cookbook in a virtual environment of its own.
#
# The cookbook pins what the server does not need and lists `tml-renderers`, which is not on
# PyPI, so it is installed as docs/service.md says: its listed dependencies (the `cookbook061`
# extra) then `--no-deps tinker-cookbook==0.6.1`. The venv sees this environment's packages
# (--system-site-packages: torch, transformers and jaxrl are not installed twice);
# $JAXRL_COOKBOOK_VENV, default .venv-cookbook in the checkout (gitignored); a venv outside the
# checkout is reused across clones while pyproject.toml and the Python are the same.
# Fails when the test fails or does not run (JAXRL_COOKBOOK_REQUIRED turns its skip into a
# failure). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
venv=$(realpath -m "${JAXRL_COOKBOOK_VENV:-.venv-cookbook}")
py=${PYTHON:-python3}
stamp=$( (cat pyproject.toml; "$py" -V) | sha256sum | cut -c1-16)
log="$venv/install.log"

deps_ok() {
  [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.jaxrl-stamp" 2>/dev/null)" = "$stamp" ] &&
    "$venv/bin/python" -c "import tinker_cookbook.recipes.math_rl.train" >/dev/null 2>&1
}

pip_install() {
  if ! "$venv/bin/python" -m pip install "$@" >>"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "cookbook.sh: pip install $* failed (log: $log)" >&2
    exit 1
  fi
}

if deps_ok; then
  echo "+ reusing $venv"
else
  echo "+ building $venv: tinker-cookbook 0.6.1 and its dependencies but tml-renderers"
  start=$(date +%s)
  rm -rf "$venv"
  "$py" -m venv --system-site-packages "$venv"
  mapfile -t deps < <("$py" -c 'import tomllib; print("\n".join(tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["cookbook061"]))')
  pip_install "${deps[@]}"
  pip_install --no-deps "tinker-cookbook==0.6.1"
  echo "$stamp" >"$venv/.jaxrl-stamp"
  echo "+ built in $(($(date +%s) - start)) s"
fi

JAXRL_COOKBOOK_PYTHON="$venv/bin/python" JAXRL_COOKBOOK_REQUIRED=1 \
  python -m pytest -q -p no:cacheprovider tests/service/test_cookbook_recipes.py "$@"
