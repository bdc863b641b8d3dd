#!/usr/bin/env bash
# Makes a private CA and one certificate per service for the TLS mode (openssl only).
#
#   deploy/tls/make-certs.sh DIR [NAME[=SAN,SAN...]]...
#
# DIR gets ca.crt and ca.key (keep ca.key off the servers), and NAME.crt / NAME.key for
# each NAME. Every certificate names NAME, localhost and 127.0.0.1 as subject alternative
# names (plus the extra SANs given: DNS names, or IP addresses), and is good for both
# server and client authentication, so one file pair serves a service's port and its
# mutual-TLS calls out. Without NAMEs: the compose stack's services (learner,
# reward-server, worker) and an `operator` client for grpcurl and the e2e.
#
# Existing CA files are reused (certificates are re-issued under the same CA: rotating a
# certificate is running this again, then SIGHUP or nothing; the services reload changed
# files within 10 s). Set DAYS (default 365) for the certificates' lifetime.
set -euo pipefail

dir="${1:?usage: make-certs.sh DIR [NAME[=SAN,SAN...]]...}"
shift
[ "$#" -gt 0 ] || set -- learner reward-server worker operator
days="${DAYS:-365}"
mkdir -p "$dir"
umask 077

if [ ! -f "$dir/ca.key" ] || [ ! -f "$dir/ca.crt" ]; then
  openssl req -x509 -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$dir/ca.key" -out "$dir/ca.crt" -days "$((days * 3))" \
    -subj "/CN=RookWorld CA $(date -u +%Y%m%dT%H%M%SZ)" \
    -addext "basicConstraints=critical,CA:TRUE" \
    -addext "keyUsage=critical,keyCertSign,cRLSign" 2>/dev/null
fi

for spec in "$@"; do
  name="${spec%%=*}"
  extra=""
  [ "$spec" != "$name" ] && extra="${spec#*=}"
  sans="DNS:$name,DNS:localhost,IP:127.0.0.1"
  IFS=',' read -ra more <<<"$extra"
  for s in "${more[@]}"; do
    [ -n "$s" ] || continue
    if [[ "$s" =~ ^[0-9.]+$ || "$s" == *:* ]]; then sans+=",IP:$s"; else sans+=",DNS:$s"; fi
  done
  ext="$(mktemp)"
  printf '%s\n' \
    "basicConstraints=critical,CA:FALSE" \
    "keyUsage=critical,digitalSignature,keyEncipherment" \
    "extendedKeyUsage=serverAuth,clientAuth" \
    "subjectAltName=$sans" >"$ext"
  openssl req -newkey ec -pkeyopt ec_paramgen_curve:P-256 -nodes \
    -keyout "$dir/$name.key" -out "$dir/$name.csr" -subj "/CN=$name" 2>/dev/null
  openssl x509 -req -in "$dir/$name.csr" -CA "$dir/ca.crt" -CAkey "$dir/ca.key" \
    -CAcreateserial -days "$days" -sha256 -extfile "$ext" -out "$dir/$name.crt" 2>/dev/null
  # PKCS#8 for every TLS stack; readable by the services' user in a mounted volume.
  openssl pkcs8 -topk8 -nocrypt -in "$dir/$name.key" -out "$dir/$name.key.tmp"
  mv "$dir/$name.key.tmp" "$dir/$name.key"
  rm -f "$dir/$name.csr" "$ext"
  echo "$dir/$name.crt ($sans)"
done
rm -f "$dir/ca.srl"
