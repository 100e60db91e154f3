# syntax=docker/dockerfile:1
# The GPU worker image: `vivant worker` with torch, Triton, PyAV and LiveKit, on a CUDA runtime base.
# Build from the repository root (docs/deploy.md):
#   docker build -f images/worker.Dockerfile -t ghcr.io/vivant-dev/vivant-worker:0.1.0 .
# Python packages come only from requirements/build.txt and requirements/worker.txt (exact pins, installed
# with --no-deps, wheels only, then `pip check`): the versions the tests run (requirements/dev.txt).
# torch 2.13.0's wheel carries its CUDA 13.0 libraries (nvidia-* pins in requirements/worker.txt; cudart
# 13.0.96 = CUDA 13.0 update 2, hence the base below); the node needs an NVIDIA driver that runs CUDA 13.0.
# Python 3.11 (the version the tests run) is a relocatable CPython build installed by uv, because the
# CUDA base's Ubuntu ships 3.12.

ARG CUDA_IMAGE=nvidia/cuda:13.0.2-runtime-ubuntu24.04
ARG UV_IMAGE=ghcr.io/astral-sh/uv:0.13.9
ARG PYTHON_VERSION=3.11.14

FROM ${UV_IMAGE} AS uv

# ---- build: Python at /opt/python, a virtual environment at /opt/vivant with the pinned packages and vivant
FROM ${CUDA_IMAGE} AS build
ARG PYTHON_VERSION
COPY --from=uv /uv /usr/local/bin/uv
ENV UV_PYTHON_INSTALL_DIR=/opt/python \
    UV_PYTHON_PREFERENCE=only-managed \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN uv python install "${PYTHON_VERSION}" \
 && uv venv --python "${PYTHON_VERSION}" /opt/vivant
WORKDIR /src
COPY requirements/build.txt requirements/worker.txt requirements/
RUN uv pip install --python /opt/vivant/bin/python --no-deps --only-binary :all: -r requirements/build.txt \
 && /opt/vivant/bin/python -m pip install --no-deps --only-binary=:all: -r requirements/worker.txt
COPY pyproject.toml README.md ./
COPY apis apis
COPY bench bench
COPY cli cli
COPY gateway gateway
COPY kernels kernels
COPY operator operator
COPY sessions sessions
COPY worker worker
RUN /opt/vivant/bin/python -m pip install --no-deps --no-build-isolation . \
 && /opt/vivant/bin/python -m pip check \
 && /opt/vivant/bin/vivant worker --help >/dev/null \
 && /opt/vivant/bin/python -c "import torch, triton, av, livekit.agents, vivant.worker.serving.cli"

# ---- runtime: CUDA base + a C compiler (Triton compiles its small launcher modules at first use)
FROM ${CUDA_IMAGE}
LABEL org.opencontainers.image.title="vivant-worker" \
      org.opencontainers.image.description="vivant GPU worker (torch, Triton, CUDA 13.0)" \
      org.opencontainers.image.licenses="Apache-2.0"
RUN apt-get update \
 && apt-get install -y --no-install-recommends gcc libc6-dev \
 && rm -rf /var/lib/apt/lists/* \
 && groupadd --gid 10001 vivant \
 && useradd --uid 10001 --gid 10001 --create-home --home-dir /home/vivant --shell /usr/sbin/nologin vivant
COPY --from=build /opt/python /opt/python
COPY --from=build /opt/vivant /opt/vivant
ENV PATH=/opt/vivant/bin:${PATH} \
    HOME=/home/vivant \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
USER 10001:10001
WORKDIR /home/vivant
# The operator's StatefulSet runs `vivant worker` with its settings in VIVANT_* variables and the NCCL /
# symmetric-memory switches that keep NVLink multicast off (operator/builders.py).
CMD ["vivant", "worker", "--help"]
