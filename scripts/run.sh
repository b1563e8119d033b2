#!/usr/bin/env bash
# Set up (idempotently) and run Baton on the embedded model; arguments go to
# the `baton` command (default: a short generation).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- generate --chat "What is the capital of France?"
fi
exec .venv/bin/baton "$@"
