#!/usr/bin/env bash
# Builds the image (deploy/docker/Containerfile) with podman and checks it: every entry point's
# --help, then the local preset's whole topology (python -m rlax_tpu launch, a tiny run) inside.
#   deploy/docker/build.sh [TAG]          (make image)
# Installs podman/buildah/debootstrap if missing. Uses debian:bookworm-slim when a registry can be
# reached, else a base made by make-base.sh. Runs inside the image with buildah's chroot
# isolation when the host cannot start OCI containers (e.g. a container without CAP_SYS_RESOURCE
# or with hybrid cgroups, as CI hosts are).
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=${1:-localhost/rlax-tpu:latest}
need=()
for pair in podman:podman buildah:buildah debootstrap:debootstrap; do
  command -v "${pair%%:*}" >/dev/null || need+=("${pair##*:}")
done
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
base=docker.io/library/debian:bookworm-slim
if ! podman image exists "$base" && ! podman pull -q "$base" >/dev/null 2>&1; then
  echo "build.sh: no registry reachable; making the base with debootstrap"
  base=localhost/rlax-base:bookworm
  podman image exists "$base" || deploy/docker/make-base.sh "$base" >/dev/null
fi
# pip inside the build trusts the host's CA bundle too (a proxy that re-signs TLS).
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
start=$(date +%s)
podman build --isolation=chroot --secret "id=ca-bundle,src=$ca" --build-arg "BASE=$base" \
  -f deploy/docker/Containerfile -t "$tag" .
echo "build.sh: built $tag from $base in $(( $(date +%s) - start )) s, $(podman image inspect "$tag" --format '{{.Size}}') bytes"

if podman run --rm "$tag" --help >/dev/null 2>&1; then
  inside() { podman run --rm "$tag" "$@"; }
else
  echo "build.sh: podman cannot start containers here ($(podman run --rm "$tag" --help 2>&1 | tail -1)); running inside with buildah --isolation=chroot"
  ctr=$(buildah from "$tag")
  trap 'buildah rm "$ctr" >/dev/null' EXIT
  inside() { buildah run --isolation=chroot "$ctr" -- python -m rlax_tpu "$@"; }
fi
for component in controller launch trainer inference param_server verifiers aot probe; do
  inside "$component" --help >/dev/null
  echo "build.sh: python -m rlax_tpu $component --help: ok"
done
inside launch --config=configs/codeforces.py:local --config.controller.run_dir=/tmp/run \
  --config.controller.num_steps=1 --config.controller.prompts_per_step=2 \
  --config.algorithm.group_size=2 --config.trainer.micro_batch_size=4 \
  --config.model.num_layers=1 --config.inference.max_new_tokens=16 \
  --config.inference.max_concurrent_seqs=8 --config.data.eval_problems=4 \
  --config.data.eval_samples=2 --config.controller.warmup_steps=5 | tail -4
echo "build.sh: the local topology ran inside $tag"
