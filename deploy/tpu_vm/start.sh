#!/usr/bin/env bash
# Starts (or resumes) the run: every process of `python -m rlax_tpu.launch.tpu_vm plan` on its
# host, in order; each logs to ~/rlax_tpu/logs/<name>.log on its host. The controller starts
# once every service answers its health probe. Usage: deploy/tpu_vm/start.sh [ENV_FILE]
source "$(dirname "$0")/common.sh"
trainer_ips="" inference_ips=""
while read -r vm _acc hosts; do
  ips=$(ips_of "$vm" "$hosts")
  if [[ $vm == "$NAME" ]]; then trainer_ips=$ips; else inference_ips+="${inference_ips:+;}$ips"; fi
done < <(vms)
plan=$(cd "$REPO" && "$PY" -m rlax_tpu.launch.tpu_vm plan "${FLAGS[@]}" --name="$NAME" \
         --trainer_ips="$trainer_ips" --inference_ips="$inference_ips")
while read -r vm worker _name command; do
  on_vm "$vm" "$worker" "$command" < /dev/null
done <<<"$plan"
