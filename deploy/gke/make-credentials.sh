#!/usr/bin/env bash
# Makes what the credentials Secret holds, in DIR: "token" (every call), "publish-token" (only the
# trainer and the parameter server get it) and "tls.pem" (a self-signed certificate for
# *.NAMESPACE.svc, the Services' names, with its key). Then create the Secret:
#   kubectl create secret generic rlax-credentials -n NAMESPACE --from-file=DIR
# Usage: deploy/gke/make-credentials.sh DIR [NAMESPACE]      (NAMESPACE: rlax)
set -euo pipefail
dir=${1:?usage: make-credentials.sh DIR [NAMESPACE]}
ns=${2:-rlax}
mkdir -p "$dir"
umask 077
openssl rand -hex 32 > "$dir/token"
openssl rand -hex 32 > "$dir/publish-token"
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
openssl req -x509 -newkey rsa:3072 -nodes -days 365 -subj "/CN=rlax.$ns.svc" \
  -addext "subjectAltName=DNS:*.$ns.svc,DNS:*.$ns.svc.cluster.local" \
  -keyout "$tmp/key.pem" -out "$tmp/cert.pem" 2>/dev/null
cat "$tmp/cert.pem" "$tmp/key.pem" > "$dir/tls.pem"
echo "wrote $dir/token, $dir/publish-token, $dir/tls.pem (for *.$ns.svc); now:"
echo "  kubectl create secret generic rlax-credentials -n $ns --from-file=$dir"
