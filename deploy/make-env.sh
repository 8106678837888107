#!/bin/sh
# Write the secrets docker-compose.yml (and docker-compose.cluster.yml, the three-node
# NATS variant) need into an env file, once.
#
#   deploy/make-env.sh [FILE]      (default: .env beside docker-compose.yml, which
#                                   `docker compose` reads by itself)
#
# Fresh random values for the gateway's API key, the metrics token, one NATS
# password per user and the NATS cluster's route password; the file is created with
# mode 0600 and an existing one is left alone, so keys survive re-runs. Keep it out
# of version control.
set -eu
out=${1:-"$(dirname "$0")/../.env"}
if [ -e "$out" ]; then
  echo "$out exists; leaving it alone"
  exit 0
fi
gen() {
  python3 -c 'import secrets; print(secrets.token_urlsafe(32))' 2>/dev/null \
    || openssl rand -hex 32
}
umask 077
{
  echo "YB_API_KEYS=yb-$(gen)"
  echo "YB_METRICS_TOKEN=$(gen)"
  for user in CONDUCTOR GATEWAY PREFILL DECODE KVSTORE ADMIN; do
    echo "YB_NATS_PASSWORD_${user}=$(gen)"
  done
  echo "YB_NATS_ROUTE_PASSWORD=$(gen)"
} > "$out"
echo "wrote $out (mode 0600); the gateway's API key is YB_API_KEYS in it"
