#!/usr/bin/env bash
# Creates the TPU VM. Usage: deploy/tpu_vm/create.sh [ENV_FILE]   (SPOT=1 for a spot VM)
source "$(dirname "$0")/common.sh"
spot=()
[[ ${SPOT:-0} == 1 ]] && spot=(--spot)
run gcloud compute tpus tpu-vm create "$NAME" --zone "$ZONE" \
  --accelerator-type "$ACCELERATOR" --version "$RUNTIME" "${spot[@]}"
