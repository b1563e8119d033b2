#!/usr/bin/env bash
# Install everything the tests need (idempotently) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh "[test]"
exec .venv/bin/python -m pytest -q -ra "$@"
