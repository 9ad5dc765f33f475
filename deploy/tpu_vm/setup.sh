#!/usr/bin/env bash
# Installs the project on every worker of the TPU VM: clone (or update) and `make setup` (the
# virtualenv, the pinned packages with libtpu, bubblewrap). Usage: deploy/tpu_vm/setup.sh [ENV_FILE]
source "$(dirname "$0")/common.sh"
: "${REPO_URL:?set REPO_URL, the git URL to clone this project from}"
on_vm all "set -e; if [ -d rlax_tpu ]; then git -C rlax_tpu pull --ff-only; else git clone $REPO_URL rlax_tpu; fi; cd rlax_tpu && sudo make setup"
