#!/usr/bin/env bash
# The test suite on jax 0.11 (CPU), which needs Python >= 3.12; the main environment's Python 3.11
# gets jax 0.10.2, the last release for it. jaxrl must run on both; CI (.ci/run) tests 0.10.
#
#   PYTHON=python3.12 .ci/jax011.sh [pytest arguments]      # default: the whole suite
#
# The venv ($JAXRL_JAX011_VENV, default ~/.cache/jaxrl/venv-jax011) is kept while it was built
# from the same pyproject.toml, install line and Python; jaxrl is installed editable and
# re-pointed at this checkout when it points elsewhere. On Python 3.12 torch==2.13.0 (the test
# extra's pin) is PyPI's CUDA build: the venv takes about 6 GB.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=$(realpath -m "${JAXRL_JAX011_VENV:-$HOME/.cache/jaxrl/venv-jax011}")
py=${PYTHON:-python3.12}
if ! "$py" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
  echo "jax011.sh: jax 0.11 needs Python >= 3.12; PYTHON=$py is not (set PYTHON=python3.12)" >&2
  exit 2
fi
install=(-e ".[test]" "jax>=0.11,<0.12")
stamp=$( (cat pyproject.toml; echo "${install[@]}"; "$py" -V) | sha256sum | cut -c1-16)
log="$venv/install.log"

if [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.jaxrl-stamp" 2>/dev/null)" = "$stamp" ]; then
  echo "+ reusing $venv"
  "$venv/bin/python" -m pip install -q --no-deps -e . >>"$log" 2>&1
else
  echo "+ building $venv with $("$py" -V)"
  rm -rf "$venv"
  "$py" -m venv "$venv"
  if ! "$venv/bin/python" -m pip install "${install[@]}" >>"$log" 2>&1; then
    tail -40 "$log" >&2
    echo "jax011.sh: pip install failed (log: $log)" >&2
    exit 1
  fi
  echo "$stamp" >"$venv/.jaxrl-stamp"
fi
"$venv/bin/python" -c 'import jax; print("+ jax", jax.__version__, "on", jax.default_backend())'
# its own compilation cache: the suite's conftest shares one across processes of one jax version
export JAX_COMPILATION_CACHE_DIR=${JAX_COMPILATION_CACHE_DIR:-/tmp/jaxrl-test-xla-cache-jax011}
PATH="$venv/bin:$PATH" exec python -m pytest -q -n 2 --dist loadfile -p no:cacheprovider "$@"
