#!/usr/bin/env bash
# A base image for the Dockerfile made from Debian's own packages, for a machine that
# cannot pull python:3.11-slim from Docker Hub:
#
#   deploy/base-image.sh [NAME]        # default yuebing-base:bookworm
#   docker build --build-arg BASE_IMAGE=yuebing-base:bookworm --build-arg SERVICE=gateway .
#
# Debian bookworm's python3 is 3.11, the version the project supports. The image holds
# python3, python3-venv, python3-pip and the CA certificates (debootstrap's minbase
# variant, about 300 MB). Needs root and a Debian mirror (DEBIAN_MIRROR, default
# deb.debian.org); installs debootstrap from apt when it is missing. Does nothing when
# the image exists.
set -euo pipefail

name=${1:-yuebing-base:bookworm}
mirror=${DEBIAN_MIRROR:-http://deb.debian.org/debian}

if docker image inspect "$name" > /dev/null 2>&1; then
  echo "[base-image] $name exists"
  exit 0
fi
if ! command -v debootstrap > /dev/null; then
  apt-get install -y --no-install-recommends debootstrap
fi

root=$(mktemp -d)
trap 'rm -rf "$root"' EXIT
started=$(date +%s)
echo "[base-image] debootstrap bookworm from $mirror"
debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
  bookworm "$root" "$mirror"
# What only the bootstrap needed: downloaded packages and the index.
rm -rf "$root"/var/cache/apt/archives/*.deb "$root"/var/lib/apt/lists/*
tar -C "$root" -c . | docker import --change 'ENV LANG=C.UTF-8' --change 'CMD ["python3"]' - "$name"
echo "[base-image] $name built in $(( $(date +%s) - started ))s:" \
  "$(docker image inspect --format '{{.Size}}' "$name") bytes"
