#!/usr/bin/env bash
# Set up (idempotently) and run Baton on the embedded model; arguments go to
# the `baton` command (default: `baton serve` on http://127.0.0.1:8000).
set -euo pipefail
cd "$(dirname "$0")/.."
./scripts/setup.sh
if [ "$#" -eq 0 ]; then
    set -- serve
fi
# glibc gives every thread that mallocs its own arena; under a long mixed load
# the server's threads grew RSS by a few percent that way (docs/benchmarks.md,
# "Soak"). Two arenas keep it flat; set MALLOC_ARENA_MAX yourself to override.
export MALLOC_ARENA_MAX="${MALLOC_ARENA_MAX:-2}"
exec .venv/bin/baton "$@"
