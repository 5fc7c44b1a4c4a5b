#!/usr/bin/env bash
# JetStream adapter tests (tests/serving) against the real `google-jetstream` package.
#
# google-jetstream 0.2.2 imports seqio, which pulls TensorFlow, so it gets its own virtual
# environment (default .venv-jetstream, gitignored) instead of the main one. The venv is reused
# when it is valid (it imports jetstream and this checkout's jaxrl, and was built from the same
# pyproject.toml and this script); otherwise it is rebuilt from scratch.
#
# Fails when the tests fail and when no test ran (pytest exit code 5: e.g. jetstream missing,
# so every test skipped at import).
set -euo pipefail
cd "$(dirname "$0")/.."
root=$(pwd)
venv=${JAXRL_JETSTREAM_VENV:-.venv-jetstream}
py=${PYTHON:-python3}
stamp_file="$venv/.jaxrl-stamp"
stamp=$(cat pyproject.toml .ci/jetstream.sh | sha256sum | cut -c1-16)

valid_venv() {
  [ -x "$venv/bin/python" ] && [ "$(cat "$stamp_file" 2>/dev/null)" = "$stamp" ] &&
    "$venv/bin/python" - "$root" >/dev/null 2>&1 <<'PY'
import os, sys
import jetstream.engine.engine_api  # noqa: F401  (imports seqio -> TensorFlow)
import jaxrl
assert os.path.realpath(jaxrl.__file__).startswith(os.path.realpath(sys.argv[1]) + os.sep)
PY
}

if valid_venv; then
  echo "+ reusing $venv"
else
  echo "+ building $venv (google-jetstream + TensorFlow via seqio; a few minutes)"
  start=$(date +%s)
  rm -rf "$venv"
  "$py" -m venv "$venv"
  "$venv/bin/python" -m pip install -q -e ".[jetstream]" "pytest>=8" "pytest-timeout>=2.3"
  echo "$stamp" >"$stamp_file"
  echo "+ $venv built in $(($(date +%s) - start)) s, $(du -sm "$venv" | cut -f1) MB"
fi

export TF_CPP_MIN_LOG_LEVEL=${TF_CPP_MIN_LOG_LEVEL:-3}
set +e
"$venv/bin/python" -m pytest -q -p no:cacheprovider tests/serving "$@"
rc=$?
set -e
if [ "$rc" -eq 5 ]; then
  echo "jetstream.sh: no test ran in tests/serving (is google-jetstream importable?)" >&2
  exit 1
fi
exit "$rc"
