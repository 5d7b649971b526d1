#!/usr/bin/env bash
# The one check script: format, lint, types, then the tests (args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
ruff format --check .
ruff check .
mypy kvstore service
python -m pytest "$@"
