#!/usr/bin/env bash
# Install everything the tests need (idempotently) and run them.
#   ./scripts/test.sh              the whole suite, as CI runs it (.ci/run)
#   ./scripts/test.sh --quick      the contributor's loop: every test not marked
#                                  `slow` (servers in subprocesses, Ray, Chromium,
#                                  Prometheus, fuzzing, torch.compile, transformers
#                                  on the embedded model)
# Further arguments go to pytest (`./scripts/test.sh --quick tests/test_scheduler.py -x`);
# both print the slowest tests (--durations).
set -euo pipefail
cd "$(dirname "$0")/.."

quick=0
if [ "${1:-}" = "--quick" ]; then
    quick=1
    shift
fi

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

./scripts/setup.sh "[test,ray,bench]"
if [ "$quick" -eq 1 ]; then
    exec .venv/bin/python -m pytest -q -ra --durations=15 -m "not slow" "$@"
fi
.venv/bin/python -m pytest -q -ra --durations=25 "$@"
# The engine-agreement tests again as an AVX2-only CPU runs them (Baton's
# avx2 kind, torch's AVX2 kernels, oneDNN and MKL capped at AVX2: no bf16 or
# AMX there), so a failure on that kind shows on any machine (skipped when the
# run was narrowed to chosen tests, and on an AVX2-only CPU, where the run
# above was that run already).
if [ "$#" -eq 0 ]; then
    if grep -qw avx512f /proc/cpuinfo 2>/dev/null; then
        BATON_CPU_KIND=avx2 ATEN_CPU_CAPABILITY=avx2 ONEDNN_MAX_CPU_ISA=AVX2 \
            MKL_ENABLE_INSTRUCTIONS=AVX2 \
            .venv/bin/python -m pytest -q -ra --durations=10 tests/test_engine_agreement.py \
            tests/test_compiled_step.py tests/test_cpu_kernels.py tests/test_segment_attention.py
    fi
    # On an AMX CPU, the compiled-step and engine tests once more as an
    # AVX512_BF16 CPU without AMX runs them (an EPYC of that kind): oneDNN
    # capped below AMX, and Baton's tile kernels with it (CpuFeatures.detect).
    if grep -qw amx_bf16 /proc/cpuinfo 2>/dev/null; then
        ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16 \
            .venv/bin/python -m pytest -q -ra --durations=5 tests/test_engine_agreement.py \
            tests/test_compiled_step.py
    fi
fi
