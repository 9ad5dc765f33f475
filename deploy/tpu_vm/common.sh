# Shared by the TPU VM scripts: settings from the environment (or an env file given as $1), and
# `run`, which prints each command and runs it unless DRY_RUN=1.
set -euo pipefail
if [[ ${1:-} && -f $1 ]]; then
  # shellcheck disable=SC1090
  source "$1"
fi
: "${NAME:?set NAME, the name of the TPU VM}"
: "${ZONE:?set ZONE, e.g. us-east5-a}"
: "${ACCELERATOR:=v5litepod-8}"          # v5litepod-8 (v5e-8), v6e-8, v5p-8: one host
: "${RUNTIME:=v2-alpha-tpuv5-lite}"      # the TPU VM software version for the accelerator
: "${BUCKET:?set BUCKET, gs://... holding the weights and codeforces data (see README)}"
: "${REPO_URL:=}"                         # git URL of this project (setup.sh clones it)
: "${CONFIG:=configs/codeforces.py:tpu_vm}"
: "${EXTRA_FLAGS:=}"                      # more --config.a.b=v flags for the run
DRY_RUN=${DRY_RUN:-0}

run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $DRY_RUN != 1 ]]; then "$@"; fi
}

# The run's flags, as every process gets them.
run_flags() {
  printf '%s' "--config=$CONFIG --config.controller.bucket=$BUCKET $EXTRA_FLAGS"
}

on_vm() {  # on_vm WORKER COMMAND: runs COMMAND in the repository on workers of the VM
  run gcloud compute tpus tpu-vm ssh "$NAME" --zone "$ZONE" --worker "$1" --command "$2"
}
