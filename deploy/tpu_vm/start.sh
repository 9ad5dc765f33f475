#!/usr/bin/env bash
# Starts (or resumes) the run on the TPU VM in the background; its output goes to
# ~/rlax_tpu/run.log on worker 0. Usage: deploy/tpu_vm/start.sh [ENV_FILE]
# One host: the controller with the tpu_vm preset (half the chips train, half generate).
source "$(dirname "$0")/common.sh"
case $ACCELERATOR in
  v5litepod-8|v5litepod-4|v6e-8|v6e-4|v5p-8|v4-8) ;;
  *) echo "start.sh: $ACCELERATOR spans several hosts; multi-host TPU VM runs are not built yet" \
       "(deploy on GKE instead: README, 'Deployment')" >&2; exit 2 ;;
esac
on_vm 0 "cd rlax_tpu && nohup .venv/bin/python -m rlax_tpu.controller $(run_flags) > run.log 2>&1 &"
