#!/usr/bin/env bash
# Stops the run (SIGTERM: the controller keeps its snapshots; start.sh resumes it) and, with
# DELETE=1, deletes the TPU VM. Usage: deploy/tpu_vm/stop.sh [ENV_FILE]
source "$(dirname "$0")/common.sh"
on_vm all "pkill -TERM -f 'python -m rlax_tpu' || true"
if [[ ${DELETE:-0} == 1 ]]; then
  run gcloud compute tpus tpu-vm delete "$NAME" --zone "$ZONE" --quiet
fi
