#!/usr/bin/env bash
# Set up (idempotently) and run Baton on the embedded model; arguments go to
# the `baton` command (default: `baton serve` on http://127.0.0.1:8000).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- serve
fi
# `baton` sets glibc's malloc itself (backends/host_malloc.py); a MALLOC_*
# variable you export is kept and wins.
exec .venv/bin/baton "$@"
