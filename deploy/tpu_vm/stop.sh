#!/usr/bin/env bash
# Stops the run on every VM (SIGTERM: the controller keeps its snapshots, start.sh resumes) and,
# with DELETE=1, deletes the VMs. A VM that cannot be reached is reported and the others are
# still stopped. Usage: deploy/tpu_vm/stop.sh [ENV_FILE]
source "$(dirname "$0")/common.sh"
# "[p]ython" matches the processes' "python -m rlax_tpu..." but not this command's own shell,
# whose command line holds the pattern (a plain "python -m rlax_tpu" would SIGTERM the ssh
# session itself: exit 143, and set -e would skip every later VM).
STOP="sudo pkill -TERM -f '[p]ython -m rlax_tpu' || true"
failed=0
while read -r vm _acc _hosts; do
  on_vm "$vm" all "$STOP" < /dev/null || { echo "stop.sh: could not stop $vm" >&2; failed=1; }
  if [[ ${DELETE:-0} == 1 ]]; then
    run gcloud compute tpus tpu-vm delete "$vm" --zone "$ZONE" --quiet < /dev/null || failed=1
  fi
done < <(vms)
exit $failed
