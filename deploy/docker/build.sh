#!/usr/bin/env bash
# Builds the image (deploy/docker/Containerfile) with podman and checks it: every entry point's
# --help, then the local preset's whole topology (python -m rlax_tpu launch, a tiny run) inside.
#   [BASE=IMAGE@sha256:DIGEST] [REGISTRY=HOST/PATH] deploy/docker/build.sh [TAG]   (make image)
# BASE defaults to the Containerfile's pinned one; a BASE without @sha256:<digest> is refused
# before anything is installed or built. With REGISTRY, the image is also tagged
# REGISTRY/<name:tag> (push that, and set topology.registry to REGISTRY).
# Installs podman/buildah/debootstrap if missing. Pulls BASE when a registry can be reached, else
# makes a Debian 12 base with make-base.sh and pins that by its digest. Runs inside the image with
# buildah's chroot isolation when the host cannot start OCI containers (e.g. a container without
# CAP_SYS_RESOURCE or with hybrid cgroups, as CI hosts are).
set -euo pipefail
cd "$(dirname "$0")/../.."
tag=${1:-localhost/rlax-tpu:latest}
base=${BASE:-$(sed -n 's/^ARG BASE=//p' deploy/docker/Containerfile)}
if ! [[ $base =~ @sha256:[0-9a-f]{64}$ ]]; then
  cat >&2 <<EOM
build.sh: BASE=$base is not pinned by digest: give IMAGE@sha256:<64 hex digits>, e.g.
  docker buildx imagetools inspect debian:bookworm-slim     (the "Digest:" line), then
  make image BASE=docker.io/library/debian:bookworm-slim@sha256:<digest>
EOM
  exit 2
fi
if [[ -n ${REGISTRY:-} && ( $REGISTRY == *://* || $REGISTRY == */ ) ]]; then
  echo "build.sh: REGISTRY=$REGISTRY must be a registry path such as us-docker.pkg.dev/PROJECT/REPO" >&2
  exit 2
fi
need=()
for pair in podman:podman buildah:buildah debootstrap:debootstrap; do
  command -v "${pair%%:*}" >/dev/null || need+=("${pair##*:}")
done
if ((${#need[@]})); then
  apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq "${need[@]}" >/dev/null
fi
if ! podman image exists "$base" && ! podman pull -q "$base" >/dev/null 2>&1; then
  echo "build.sh: cannot pull $base (no registry reachable?); making a Debian 12 base with debootstrap"
  local_base=localhost/rlax-base:bookworm
  podman image exists "$local_base" || deploy/docker/make-base.sh "$local_base" >/dev/null
  base="localhost/rlax-base@$(podman image inspect --format '{{.Digest}}' "$local_base")"
  echo "build.sh: base $base (pinned by the digest podman gave it)"
fi
# pip inside the build trusts the host's CA bundle too (a proxy that re-signs TLS).
ca=${PIP_CERT:-/etc/ssl/certs/ca-certificates.crt}
start=$(date +%s)
podman build --isolation=chroot --secret "id=ca-bundle,src=$ca" --build-arg "BASE=$base" \
  -f deploy/docker/Containerfile -t "$tag" .
echo "build.sh: built $tag from $base in $(( $(date +%s) - start )) s, $(podman image inspect "$tag" --format '{{.Size}}') bytes"

user=$(podman image inspect "$tag" --format '{{.Config.User}}')
if [[ $user != 1000:1000 ]]; then
  echo "build.sh: $tag runs as user '$user', not 1000:1000 (rlax_tpu/launch/gke.py RUN_AS_UID)" >&2
  exit 1
fi
# inside: as the image's user (every component but the verifiers); as_root: as the verifiers run.
if podman run --rm "$tag" --help >/dev/null 2>&1; then
  inside() { podman run --rm "$tag" "$@"; }
  as_root() { podman run --rm --user 0:0 "$tag" "$@"; }
  uid() { podman run --rm --entrypoint id "$tag" -u; }
else
  echo "build.sh: podman cannot start containers here ($(podman run --rm "$tag" --help 2>&1 | tail -1)); running inside with buildah --isolation=chroot"
  ctr=$(buildah from "$tag")
  trap 'buildah rm "$ctr" >/dev/null' EXIT
  inside() { buildah run --isolation=chroot --user 1000:1000 "$ctr" -- python -m rlax_tpu "$@"; }
  as_root() { buildah run --isolation=chroot --user 0:0 "$ctr" -- python -m rlax_tpu "$@"; }
  uid() { buildah run --isolation=chroot --user 1000:1000 "$ctr" -- id -u; }
fi
[[ $(uid) == 1000 ]] || { echo "build.sh: the image's processes do not run as uid 1000" >&2; exit 1; }
for component in controller launch trainer inference param_server verifiers aot probe; do
  inside "$component" --help >/dev/null
  echo "build.sh: python -m rlax_tpu $component --help as uid 1000: ok"
done
# The local topology starts the verifiers too, whose sandbox needs root (their pods run as 0).
as_root launch --config=configs/codeforces.py:local --config.controller.run_dir=/tmp/run \
  --config.controller.num_steps=1 --config.controller.prompts_per_step=2 \
  --config.algorithm.group_size=2 --config.trainer.micro_batch_size=4 \
  --config.model.num_layers=1 --config.inference.max_new_tokens=16 \
  --config.inference.max_concurrent_seqs=8 --config.data.eval_problems=4 \
  --config.data.eval_samples=2 --config.controller.warmup_steps=5 | tail -4
echo "build.sh: the local topology ran inside $tag"
if [[ -n ${REGISTRY:-} ]]; then
  remote="$REGISTRY/${tag#localhost/}"
  podman tag "$tag" "$remote"
  echo "build.sh: tagged $remote; push it with: podman push $remote"
  echo "build.sh: and render with --config.topology.registry=$REGISTRY (topology.image: ${tag#localhost/})"
fi
