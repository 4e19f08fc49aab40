#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run): lint, format, types, then the test suite, and the
# time it all took. `--fast` (first) runs the fast lane: the tests not marked `slow`. Other arguments go to
# pytest (e.g. ./check.sh tests/determinism -x). The tests run in
# PYTEST_WORKERS processes (pytest-xdist, default 2), a test file per process: most of the suite's time is
# fits in fresh subprocesses, whose start-up and waits overlap; the files of slow tests are handed out first
# (tests/conftest.py), so that the run does not end on one long file. The C++ extension is built (or found in
# its cache) once at the session's start, before the workers start (tests/conftest.py).
set -euo pipefail
cd "$(dirname "$0")"
started=$SECONDS
trap 'status=$?; echo "check.sh: $((SECONDS - started)) s, exit status $status"' EXIT
fast=()
if [ "${1:-}" = "--fast" ]; then
  shift
  fast=(-m "not slow")
fi
ruff check .
ruff format --check .
mypy
python -m pytest -q -n "${PYTEST_WORKERS:-2}" --dist loadfile --no-loadscope-reorder "${fast[@]}" "$@"
