#!/usr/bin/env bash
# Creates the TPU VMs the config needs (one for the tpu_vm preset; the trainer's slice and one per
# inference worker otherwise). Usage: deploy/tpu_vm/create.sh [ENV_FILE]   (SPOT=1: spot VMs)
source "$(dirname "$0")/common.sh"
spot=()
[[ ${SPOT:-0} == 1 ]] && spot=(--spot)
vms | while read -r vm accelerator _hosts; do
  run gcloud compute tpus tpu-vm create "$vm" --zone "$ZONE" --accelerator-type "$accelerator" \
    --version "$(runtime_of "$accelerator")" "${spot[@]}"
done
