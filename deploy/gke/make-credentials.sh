#!/usr/bin/env bash
# Makes what the credentials Secret holds, in DIR: "token" (every call), "publish-token" (only the
# trainer and the parameter server get it) and "tls.pem" (a self-signed certificate for
# *.NAMESPACE.svc, the Services' names, with its key). Then create the Secret:
#   kubectl create secret generic rlax-credentials -n NAMESPACE --from-file=DIR
# Usage: deploy/gke/make-credentials.sh DIR [NAMESPACE [NAME ...]]    (NAMESPACE: rlax)
# NAMEs (IP addresses or host names) are added to the certificate: TPU VMs are dialed by address.
set -euo pipefail
dir=${1:?usage: make-credentials.sh DIR [NAMESPACE [NAME ...]]}
ns=${2:-rlax}
shift $(( $# < 2 ? $# : 2 ))
sans="DNS:*.$ns.svc,DNS:*.$ns.svc.cluster.local"
for name in "$@"; do
  if [[ $name =~ ^[0-9.]+$ || $name == *:* ]]; then sans+=",IP:$name"; else sans+=",DNS:$name"; fi
done
mkdir -p "$dir"
umask 077
openssl rand -hex 32 > "$dir/token"
openssl rand -hex 32 > "$dir/publish-token"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
openssl req -x509 -newkey rsa:3072 -nodes -days 365 -subj "/CN=rlax.$ns.svc" \
  -addext "subjectAltName=$sans" \
  -keyout "$tmp/key.pem" -out "$tmp/cert.pem" 2>/dev/null
cat "$tmp/cert.pem" "$tmp/key.pem" > "$dir/tls.pem"
echo "wrote $dir/token, $dir/publish-token, $dir/tls.pem (for $sans); on GKE now:"
echo "  kubectl create secret generic rlax-credentials -n $ns --from-file=$dir"
