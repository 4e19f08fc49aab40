#!/usr/bin/env bash
# The test command of the README and of CI (.ci/run): lint, format, types, then the test suite.
# Extra arguments go to pytest (e.g. ./check.sh tests/determinism -x).
set -euo pipefail
cd "$(dirname "$0")"
ruff check .
ruff format --check .
mypy
python -m pytest -q "$@"
