# Shared by the TPU VM scripts: settings from the environment (or an env file given as $1), and
# `run`, which prints each command and runs it unless DRY_RUN=1.
set -euo pipefail
if [[ ${1:-} && -f $1 ]]; then
  # shellcheck disable=SC1090
  source "$1"
fi
: "${NAME:?set NAME, the name of the TPU VM (inference VMs get -inference-<i>)}"
: "${ZONE:?set ZONE, e.g. us-east5-a}"
: "${BUCKET:?set BUCKET, gs://... holding the weights and codeforces data (see README)}"
: "${CONFIG:=configs/codeforces.py:tpu_vm}"  # tpu_vm: one VM; v5p_small: a multi-host trainer VM + worker VMs
: "${ACCELERATOR:=v5litepod-8}"                # the one VM of the tpu_vm preset: v5litepod-8, v6e-8, v5p-8
: "${EXTRA_FLAGS:=}"                            # more --config.a.b=v flags for the run
: "${REPO_URL:=}"                               # git URL of this project (setup.sh clones it)
DRY_RUN=${DRY_RUN:-0}
REPO=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
PY=$REPO/.venv/bin/python
[[ -x $PY ]] || PY=python3

run() {
  printf '+'; printf ' %q' "$@"; printf '\n'
  if [[ $DRY_RUN != 1 ]]; then "$@"; fi
}

# The run's flags, as every process gets them.
# shellcheck disable=SC2206
FLAGS=(--config="$CONFIG" --config.controller.bucket="$BUCKET" $EXTRA_FLAGS)

vms() {  # one line per VM: NAME ACCELERATOR HOSTS
  (cd "$REPO" && "$PY" -m rlax_tpu.launch.tpu_vm vms "${FLAGS[@]}" --name="$NAME" \
     --accelerator="$ACCELERATOR")
}

runtime_of() {  # the TPU VM software version for an accelerator type (RUNTIME overrides)
  if [[ -n ${RUNTIME:-} ]]; then echo "$RUNTIME"; return; fi
  case $1 in
    v5litepod-*) echo v2-alpha-tpuv5-lite ;;
    v6e-*) echo v2-alpha-tpuv6e ;;
    v5p-*) echo v2-alpha-tpuv5 ;;
    *) echo tpu-ubuntu2204-base ;;
  esac
}

ips_of() {  # ips_of VM HOSTS: the hosts' internal addresses, comma-separated, in worker order
  if [[ $DRY_RUN == 1 ]]; then  # made-up addresses, one subnet per VM
    local n=$(( $(cksum <<<"$1" | cut -d' ' -f1) % 200 + 10 )) out=() w
    for ((w = 0; w < $2; w++)); do out+=("10.0.$n.$((w + 2))"); done
    (IFS=,; echo "${out[*]}")
    return
  fi
  gcloud compute tpus tpu-vm describe "$1" --zone "$ZONE" --format=json |
    python3 -c 'import json, sys; print(",".join(e["ipAddress"] for e in json.load(sys.stdin)["networkEndpoints"]))'
}

on_vm() {  # on_vm VM WORKER COMMAND: runs COMMAND on that worker (or "all") of the VM
  run gcloud compute tpus tpu-vm ssh "$1" --zone "$ZONE" --worker "$2" --command "$3"
}
