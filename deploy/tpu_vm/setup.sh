#!/usr/bin/env bash
# On every host of every VM: clone (or update) the project and `make setup`; then the run's
# credentials (deploy/gke/make-credentials.sh: tokens and a certificate naming every host's
# address) into /etc/rlax on each. Usage: deploy/tpu_vm/setup.sh [ENV_FILE]
source "$(dirname "$0")/common.sh"
: "${REPO_URL:?set REPO_URL, the git URL to clone this project from}"
mapfile -t lines < <(vms)
names=(127.0.0.1)
for line in "${lines[@]}"; do
  read -r vm _acc hosts <<<"$line"
  # Cloud TPU VM images are Ubuntu 22.04, whose python3 is 3.10; the project needs 3.11 (its
  # universe package; the Makefile picks the newest Python >= 3.11 on PATH).
  on_vm "$vm" all "set -e; command -v python3.11 >/dev/null || { sudo apt-get update -qq && sudo apt-get install -y -qq python3.11 python3.11-venv; }; if [ -d rlax_tpu ]; then git -C rlax_tpu pull --ff-only; else git clone $REPO_URL rlax_tpu; fi; cd rlax_tpu && sudo make setup"
  IFS=, read -r -a ips <<<"$(ips_of "$vm" "$hosts")"
  names+=("${ips[@]}")
done
creds=$(mktemp -d)
trap 'rm -rf "$creds"' EXIT
run bash "$REPO/deploy/gke/make-credentials.sh" "$creds/rlax" rlax "${names[@]}"
for line in "${lines[@]}"; do
  read -r vm _acc _hosts <<<"$line"
  run gcloud compute tpus tpu-vm scp --zone "$ZONE" --worker all --recurse "$creds/rlax" "$vm:rlax-credentials"
  # Readable by root and the login user's group only (the services run as either): the token
  # lets a caller publish or pull weights and run code.
  on_vm "$vm" all 'sudo install -d -m 0750 -g "$(id -gn)" /etc/rlax && sudo install -m 0640 -g "$(id -gn)" rlax-credentials/* /etc/rlax/ && rm -rf rlax-credentials'
done
