#!/usr/bin/env bash
# A real compose run, from build to `down -v`, of docker-compose.yml, of the
# three-node NATS variant and of the elastic variant. Exits 0 only when every check
# passed.
#
#   deploy/compose-smoke.sh [single] [cluster] [elastic]   (default: all three)
#
# (from a checkout set up with ./setup.sh). For each variant it builds and starts the
# cluster and waits until every service is healthy. The single and cluster variants
# then chat through the official `openai` client (whole and streamed), send one long
# prompt twice and expect cached tokens the second time, SIGKILL decode mid-stream and
# expect the clean error and a served request once compose restarted it, and restart
# NATS and expect the event log to survive. The elastic variant
# (docker-compose.elastic.yml, the planner's threshold rule every 5 s over a 30 s
# window, at most 5 engines) chats, then drives a load step through the gateway until the planner adds
# an engine: its container must appear, become healthy and announce itself; then the
# load falls, and each engine the actuator drains must stop on SIGTERM with exit code 0
# and be removed; no request of the load may fail. Every variant ends with `down -v`
# and a check that no container, volume or network of the project is left.
#
# deploy/compose-env.sh chooses the compose command and where the images come from: where
# Docker Hub cannot be reached it builds its own base image (deploy/base-image.sh); where
# PyTorch's index cannot be reached it installs torch from PyPI's index with the CPU
# wheel fetched locally. It needs a `docker` that builds with BuildKit and
# `docker compose` or docker-compose.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${YB_VENV:-.venv}/bin/python
PROJECT=ybsmoke
started_all=$(date +%s)

say() { echo "[compose-smoke] $*"; }
fail() { say "FAILED: $*"; exit 1; }

# --- the tools and where the images come from -------------------------------------------
env_lines=$(deploy/compose-env.sh) || fail "deploy/compose-env.sh"
eval "$env_lines"

# --- one variant ------------------------------------------------------------------------
env_made=0
if [ ! -e .env ]; then
  deploy/make-env.sh > /dev/null
  env_made=1
fi
cleanup() {
  "${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" down -v --remove-orphans > /dev/null 2>&1 || true
  if [ "$env_made" = 1 ]; then rm -f .env; fi
}
trap cleanup EXIT

# What each container of the project is doing, and the last health probes of those
# that are not healthy: printed before a failure is cleaned up.
describe() {
  local id
  for id in $(docker ps -aq --filter "label=com.docker.compose.project=$PROJECT"); do
    docker inspect -f '  {{.Name}}: {{.State.Status}} (exit {{.State.ExitCode}}) health {{if .State.Health}}{{.State.Health.Status}}{{range .State.Health.Log}}
      {{.Start.Format "15:04:05"}} exit {{.ExitCode}}: {{printf "%.200s" .Output}}{{end}}{{else}}-{{end}}' "$id"
  done
}

wait_healthy() {
  local want=$1 deadline=$(( $(date +%s) + 600 )) healthy
  while :; do
    healthy=$(docker ps --filter "label=com.docker.compose.project=$PROJECT" \
      --format '{{.Status}}' | grep -c '(healthy)' || true)
    [ "$healthy" -ge "$want" ] && return 0
    [ "$(date +%s)" -lt "$deadline" ] || { describe; fail "only $healthy of $want services healthy after 600s"; }
    sleep 2
  done
}

run_variant() {
  local name=$1 services=$2 checks=$3 t0 t1
  shift 3
  files=("$@")
  say "== $name: up --build"
  t0=$(date +%s)
  "${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" up -d --build > "/tmp/$PROJECT-$name-up.log" 2>&1 \
    || { tail -20 "/tmp/$PROJECT-$name-up.log"; describe; fail "$name: up --build"; }
  wait_healthy "$services"
  t1=$(date +%s)
  say "$name: $services services healthy $(( t1 - t0 ))s after up --build"
  for check in $checks; do
    "$PY" deploy/compose_checks.py "$check" --project "$PROJECT" || { describe; fail "$name: $check"; }
  done
  docker stats --no-stream --format '{{.Name}} {{.MemUsage}}' \
    $(docker ps -q --filter "label=com.docker.compose.project=$PROJECT") | sort | sed 's/^/  /'
  # No --remove-orphans: `down` itself must remove the engines the actuator added.
  "${COMPOSE[@]}" -p "$PROJECT" "${files[@]}" down -v > /dev/null 2>&1
  local left
  left=$( { docker ps -aq --filter "label=com.docker.compose.project=$PROJECT";
            docker volume ls -q --filter "label=com.docker.compose.project=$PROJECT";
            docker network ls -q --filter "label=com.docker.compose.project=$PROJECT"; } | wc -l)
  [ "$left" -eq 0 ] || fail "$name: down -v left $left containers, volumes or networks"
  say "$name: passed; down -v left nothing"
}

# The planner's settings for a run of minutes (its defaults are for hours), as
# benchmarks/elastic_live.py sets them. The threshold rule (how busy the engines' load
# reports find them) asks for a prefill engine under any load that keeps them busy;
# the forecast rule prices the load with the conductor's built-in cost model, which on
# a small shared host may never ask for one under a load the host serves unrefused.
elastic_env=(
  YB_CONDUCTOR__PLANNER_RULE=threshold
  YB_CONDUCTOR__PLANNER_INTERVAL_S=5 YB_CONDUCTOR__PLANNER_WINDOW_S=30
  YB_CONDUCTOR__PLANNER_LEAD_S=10 YB_CONDUCTOR__PLANNER_DOWN_AFTER_S=30
  YB_CONDUCTOR__PLANNER_MAX_INSTANCES=5
)

files=()
variants=("$@")
[ ${#variants[@]} -gt 0 ] || variants=(single cluster elastic)
for variant in "${variants[@]}"; do
  case $variant in
    single) run_variant single 8 "chat reuse decode-killed nats-restarted" -f docker-compose.yml ;;
    cluster)
      run_variant cluster 10 "chat reuse decode-killed nats-restarted" \
        -f docker-compose.yml -f docker-compose.cluster.yml ;;
    elastic)
      export "${elastic_env[@]}"
      run_variant elastic 9 "chat elastic" -f docker-compose.yml -f docker-compose.elastic.yml
      unset "${elastic_env[@]%%=*}" ;;
    *) fail "no variant $variant (single, cluster, elastic)" ;;
  esac
done
say "every check passed in $(( $(date +%s) - started_all ))s"
