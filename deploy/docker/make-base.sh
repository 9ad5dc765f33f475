#!/usr/bin/env bash
# Makes a Debian 12 (bookworm) base image without a registry: debootstrap a minimal root file
# system from the Debian mirror and import it. Usage: deploy/docker/make-base.sh [TAG]
set -euo pipefail
tag=${1:-localhost/rlax-base:bookworm}
engine=$(command -v podman || command -v buildah)
root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
debootstrap --variant=minbase bookworm "$root" http://deb.debian.org/debian >/dev/null
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
if [[ $engine == *podman ]]; then
  tar -C "$root" -c . | podman import - "$tag" >/dev/null
else
  ctr=$(buildah from scratch)
  buildah copy "$ctr" "$root" / >/dev/null
  buildah commit "$ctr" "$tag" >/dev/null
  buildah rm "$ctr" >/dev/null
fi
echo "$tag"
