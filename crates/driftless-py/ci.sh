#!/usr/bin/env bash
# Builds and tests the Python package. Usage: crates/driftless-py/ci.sh VENV
# VENV: a Python virtual environment with pip. Installs the package from source (release build
# through maturin, pulled from PyPI by pip as the build backend) plus the test dependencies,
# then runs the package's pytest suite. The object-storage test servers are used when
# DRIFTLESS_TEST_S3_SEAWEED is set (.ci/services.sh start); DRIFTLESS_REQUIRE_SERVERS=1 makes
# their absence a failure.
set -euo pipefail
venv=${1:?usage: ci.sh VENV}
here=$(cd "$(dirname "$0")" && pwd)
root=$(cd "$here/../.." && pwd)
venv=$(cd "$venv" && pwd)
# Share the workspace's target directory so dependencies compiled for the workspace with the
# same features are reused (the crate is its own workspace, but the artifacts are the same).
export CARGO_TARGET_DIR=${CARGO_TARGET_DIR:-$root/target}
cd "$root"
echo "== pip install ./crates/driftless-py (${DRIFTLESS_PY_PROFILE:-release} build)"
start=$(date +%s)
"$venv/bin/pip" install --disable-pip-version-check -q pytest "numpy>=1.22" ml_dtypes safetensors cryptography
# DRIFTLESS_PY_PROFILE=dev (what .ci/run sets) builds the extension with the dev profile, which
# mirrors the workspace's (dependencies at opt-level 2): CI then reuses most of the artifacts
# of its debug build instead of compiling every dependency again in release. A plain
# `pip install ./crates/driftless-py` builds release.
if [ -n "${DRIFTLESS_PY_PROFILE:-}" ]; then
  export MATURIN_PEP517_ARGS="--profile ${DRIFTLESS_PY_PROFILE}"
fi
"$venv/bin/pip" install --disable-pip-version-check -q --force-reinstall --no-deps ./crates/driftless-py
echo "   built and installed in $(( $(date +%s) - start )) s"
echo "== pytest crates/driftless-py/tests"
# Run from outside the source tree so the installed package (with its extension) is imported.
cd "$here/tests"
"$venv/bin/python" -m pytest -q -p no:cacheprovider .
