# syntax=docker/dockerfile:1
# The control-plane image: the operator (`vivant operator`), the session gateway (`vivant api`) and the
# flags CLI (`vivant flags`). No torch, no Triton. Build from the repository root (docs/deploy.md):
#   docker build -f images/control-plane.Dockerfile -t ghcr.io/vivant-dev/vivant-control-plane:0.1.0 .
# Python packages come only from requirements/build.txt and requirements/control-plane.txt (exact pins,
# installed with --no-deps, wheels only, then `pip check`): the versions the tests run (requirements/dev.txt).

ARG PYTHON_IMAGE=python:3.11.14-slim-bookworm

# ---- build: a virtual environment at /opt/vivant with the pinned packages and vivant itself
FROM ${PYTHON_IMAGE} AS build
ENV PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PYTHONDONTWRITEBYTECODE=1
RUN python -m venv /opt/vivant
WORKDIR /src
COPY requirements/build.txt requirements/control-plane.txt requirements/
RUN /opt/vivant/bin/python -m pip install --no-deps --only-binary=:all: -r requirements/build.txt \
 && /opt/vivant/bin/python -m pip install --no-deps --only-binary=:all: -r requirements/control-plane.txt
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
 && /opt/vivant/bin/vivant operator --help >/dev/null \
 && /opt/vivant/bin/vivant api --help >/dev/null \
 && ! /opt/vivant/bin/python -c "import torch" 2>/dev/null

# ---- runtime: the same Python, the environment, a numeric non-root user
FROM ${PYTHON_IMAGE}
LABEL org.opencontainers.image.title="vivant-control-plane" \
      org.opencontainers.image.description="vivant operator and session gateway (no torch)" \
      org.opencontainers.image.licenses="Apache-2.0"
ENV PATH=/opt/vivant/bin:${PATH} \
    PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1
RUN groupadd --gid 10001 vivant \
 && useradd --uid 10001 --gid 10001 --no-create-home --home-dir /nonexistent --shell /usr/sbin/nologin vivant
COPY --from=build /opt/vivant /opt/vivant
USER 10001:10001
WORKDIR /tmp
# The chart runs `vivant operator ...` and `vivant api ...` (charts/vivant/templates).
CMD ["vivant", "--help"]
