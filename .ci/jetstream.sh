#!/usr/bin/env bash
# JetStream adapter tests (tests/serving) against the real `google-jetstream` package.
#
# google-jetstream 0.2.2 imports seqio, which pulls TensorFlow (~2.3 GB installed on top of
# jaxrl's own dependencies), so it gets its own virtual environment instead of the main one:
# $JAXRL_JETSTREAM_VENV, default .venv-jetstream in the checkout (gitignored). A venv outside
# the checkout (e.g. under ~/.cache) is reused across clones.
#
# Reuse: the venv is kept while it was built from the same pyproject.toml, install line and
# Python, and still imports jetstream; jaxrl is installed editable, and re-pointed at this
# checkout when it points elsewhere.
# Fails when the tests fail and when no test ran (pytest exit code 5, e.g. every test skipped
# because jetstream does not import). Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=$(realpath -m "${JAXRL_JETSTREAM_VENV:-.venv-jetstream}")
py=${PYTHON:-python3}
install=(-e ".[jetstream]" "pytest>=8" "pytest-timeout>=2.3")
stamp=$( (cat pyproject.toml; echo "${install[@]}"; "$py" -V) | sha256sum | cut -c1-16)
log="$venv/install.log"

deps_ok() {
  [ -x "$venv/bin/python" ] && [ "$(cat "$venv/.jaxrl-stamp" 2>/dev/null)" = "$stamp" ] &&
    "$venv/bin/python" -c "import jetstream.core.orchestrator" >/dev/null 2>&1
}

jaxrl_here() {  # the venv's jaxrl is this checkout's (run outside the checkout)
  (cd / && "$venv/bin/python" - "$root" >/dev/null 2>&1) <<'PY'
import os, sys
import jaxrl
assert os.path.realpath(jaxrl.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
PY
}

pip_install() {
  if ! "$venv/bin/python" -m pip install "$@" >>"$log" 2>&1; then
    grep -v "^WARNING: Location" "$log" | tail -40 >&2
    echo "jetstream.sh: pip install $* failed (log: $log)" >&2
    exit 1
  fi
}

if deps_ok; then
  echo "+ reusing $venv"
  jaxrl_here || { echo "+ pointing its jaxrl at $root"; pip_install --no-deps -e .; }
else
  echo "+ building $venv: google-jetstream 0.2.2 + TensorFlow (through seqio) + jaxrl"
  start=$(date +%s)
  rm -rf "$venv"
  "$py" -m venv "$venv"
  pip_install "${install[@]}"
  echo "$stamp" >"$venv/.jaxrl-stamp"
  echo "+ built in $(($(date +%s) - start)) s, $(du -sm "$venv" | cut -f1) MB"
fi

export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-3}
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/serving "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "jetstream.sh: no test ran in tests/serving (does jetstream import in $venv?)" >&2
  exit 1
fi
exit "$rc"
