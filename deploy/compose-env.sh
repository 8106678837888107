#!/usr/bin/env bash
# Prints, as `export` lines for `eval`, what building and running the compose files
# takes on this machine; says on stderr what it chose and why.
#
#   eval "$(deploy/compose-env.sh)"      # then "${COMPOSE[@]}" is the compose command
#
# - COMPOSE (and YB_COMPOSE, the same as a JSON list): `docker compose`, else
#   docker-compose.
# - BuildKit for compose's builds (COMPOSE_DOCKER_CLI_BUILD, DOCKER_BUILDKIT). A docker
#   CLI without its buildx plugin cannot build with it; Debian's docker.io CLI (20.10)
#   has BuildKit built in, and is put first on PATH then.
# - YB_BASE_IMAGE: python:3.11-slim where Docker Hub answers, else the image
#   deploy/base-image.sh makes from Debian's packages (built here if missing).
# - YB_TORCH_INDEX: PyPI's index where PyTorch's cannot be reached, with the CPU wheel
#   fetched into deploy/wheels/ (`pip download torch==2.13.0+cpu`).
# - The CA bundle pip trusts here (`cert` in `pip config list`, a proxy's CA, say) is
#   copied into deploy/certs/ when that holds no certificate yet: the builds trust it.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${YB_VENV:-.venv}/bin/python
say() { echo "[compose-env] $*" >&2; }
fail() { say "FAILED: $*"; exit 1; }
out() { printf 'export %s=%q\n' "$1" "$2"; }

if docker compose version > /dev/null 2>&1; then
  compose=(docker compose)
elif command -v docker-compose > /dev/null; then
  compose=(docker-compose)
else
  fail "neither 'docker compose' nor docker-compose is installed"
fi
printf 'COMPOSE=(%s)\n' "$(printf '%q ' "${compose[@]}")"
out YB_COMPOSE "$("$PY" -c 'import json, sys; print(json.dumps(sys.argv[1:]))' "${compose[@]}")"

out COMPOSE_DOCKER_CLI_BUILD 1
out DOCKER_BUILDKIT 1
if ! docker buildx version > /dev/null 2>&1; then
  [ -x /usr/bin/docker ] || fail "the docker CLI has no buildx plugin and there is no other"
  shim=${TMPDIR:-/tmp}/yb-docker-shim
  mkdir -p "$shim"
  ln -sf /usr/bin/docker "$shim/docker"
  out PATH "$shim:$PATH"
  say "building with /usr/bin/docker ($(/usr/bin/docker version --format '{{.Client.Version}}'))"
fi

if timeout 60 docker pull -q python:3.11-slim > /dev/null 2>&1; then
  out YB_BASE_IMAGE python:3.11-slim
else
  say "Docker Hub is out of reach: the base image is built from Debian"
  deploy/base-image.sh >&2
  out YB_BASE_IMAGE yuebing-base:bookworm
fi

if ! timeout 30 "$PY" -c 'import urllib.request as u; u.urlopen("https://download.pytorch.org/whl/cpu/torch/", timeout=20)' 2> /dev/null; then
  say "PyTorch's index is out of reach: torch from PyPI's index and a local CPU wheel"
  out YB_TORCH_INDEX https://pypi.org/simple
  ls deploy/wheels/torch-2.13.0+cpu-*.whl > /dev/null 2>&1 \
    || "$PY" -m pip download -q --no-deps -d deploy/wheels "torch==2.13.0+cpu" >&2 \
    || fail "no torch 2.13.0+cpu wheel to be had (put one in deploy/wheels/)"
fi

cert=$("$PY" -m pip config list 2> /dev/null | sed -n "s/^[^=]*\.cert='\(.*\)'\$/\1/p" | head -1)
if [ -n "$cert" ] && [ -f "$cert" ] && ! ls deploy/certs/*.crt > /dev/null 2>&1; then
  say "the builds trust pip's CA bundle here ($cert)"
  cp "$cert" deploy/certs/pip-cert.crt
fi
