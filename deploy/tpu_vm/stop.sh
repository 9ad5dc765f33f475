#!/usr/bin/env bash
# Stops the run on every VM (SIGTERM: the controller keeps its snapshots, start.sh resumes) and,
# with DELETE=1, deletes the VMs. Usage: deploy/tpu_vm/stop.sh [ENV_FILE]
source "$(dirname "$0")/common.sh"
vms | while read -r vm _acc _hosts; do
  on_vm "$vm" all "sudo pkill -TERM -f 'python -m rlax_tpu' || true" < /dev/null
  if [[ ${DELETE:-0} == 1 ]]; then
    run gcloud compute tpus tpu-vm delete "$vm" --zone "$ZONE" --quiet < /dev/null
  fi
done
