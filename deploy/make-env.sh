#!/bin/sh
# Write the secrets docker-compose.yml (and docker-compose.cluster.yml, the three-node
# NATS variant) need into an env file.
#
#   deploy/make-env.sh [FILE]      (default: .env beside docker-compose.yml, which
#                                   `docker compose` reads by itself)
#
# Fresh random values for the gateway's API key, the metrics token, one NATS
# password per user, the NATS cluster's route password and Grafana's admin password
# (the observability profile). The file is created with mode 0600; in an existing one
# every value is kept (keys handed out stay valid) and only the ones it lacks are
# added, so a file from an older checkout gains what a newer compose file needs. Keep
# it out of version control.
set -eu
out=${1:-"$(dirname "$0")/../.env"}
gen() {
  python3 -c 'import secrets; print(secrets.token_urlsafe(32))' 2>/dev/null \
    || openssl rand -hex 32
}
umask 077
[ -e "$out" ] || : > "$out"
added=""
add() {  # add NAME VALUE: append unless the file already sets NAME
  if ! grep -q "^$1=" "$out"; then
    echo "$1=$2" >> "$out"
    added="$added $1"
  fi
}
add YB_API_KEYS "yb-$(gen)"
add YB_METRICS_TOKEN "$(gen)"
for user in CONDUCTOR GATEWAY PREFILL DECODE KVSTORE ADMIN; do
  add "YB_NATS_PASSWORD_${user}" "$(gen)"
done
add YB_NATS_ROUTE_PASSWORD "$(gen)"
add YB_GRAFANA_ADMIN_PASSWORD "$(gen)"
if [ -n "$added" ]; then
  echo "wrote$added to $out (mode 0600); the gateway's API key is YB_API_KEYS in it"
else
  echo "$out has every secret; leaving it alone"
fi
