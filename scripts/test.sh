#!/usr/bin/env bash
# Install everything the tests need (idempotently) and run the whole suite.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages for the integration tests: a real Prometheus server (and
# promtool), docker-compose to validate the compose stack without an engine,
# and Chromium to load the built-in dashboard headless.
need=()
command -v prometheus >/dev/null 2>&1 || need+=(prometheus)
command -v promtool >/dev/null 2>&1 || need+=(prometheus)
command -v docker-compose >/dev/null 2>&1 || need+=(docker-compose)
command -v chromium >/dev/null 2>&1 || need+=(chromium)
# Baton's native CPU kernels are built with the system C and C++ compilers.
command -v cc >/dev/null 2>&1 || need+=(gcc libc6-dev)
command -v c++ >/dev/null 2>&1 || need+=(g++)
if [ "${#need[@]}" -gt 0 ]; then
    SUDO=""
    [ "$(id -u)" -eq 0 ] || SUDO="sudo"
    $SUDO apt-get update -qq
    DEBIAN_FRONTEND=noninteractive $SUDO apt-get install -y -qq --no-install-recommends "${need[@]}"
fi

./scripts/setup.sh "[test,ray]"
exec .venv/bin/python -m pytest -q -ra "$@"
