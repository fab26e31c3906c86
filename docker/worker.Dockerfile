# syntax=docker/dockerfile:1
# AgentServing worker image (prefill and decode pools, reference engine): transformers on the
# CPU with LMCache as the CPU-DRAM and local-disk KV store, and the memory API.
# `agentserving worker --role prefill|decode ...` (the operator renders the command line).
# Build from the repository root (BuildKit reads docker/worker.Dockerfile.dockerignore):
#   docker build -f docker/worker.Dockerfile -t agentserving/worker:0.1.0 .
# vLLM / vLLM-Ascend pools use the upstream vLLM images instead.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG TORCH_VERSION=2.13.0
ARG LMCACHE_VERSION=0.5.6
# Where the CPU torch wheel comes from, required (scripts/images.sh passes the index the
# machine's pip is configured with).
ARG TORCH_INDEX_URL

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir "pip==25.3" "setuptools>=77.0.3,<81" wheel
COPY . .
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels .

FROM ${PYTHON_IMAGE}
ARG TORCH_VERSION
ARG LMCACHE_VERSION
ARG TORCH_INDEX_URL
# numba (LMCache's CPU kernels) caches compiled code beside its sources unless told where: the
# non-root user cannot write site-packages, and LMCache then falls back to CLI-only mode.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HF_HOME=/tmp/hf NUMBA_CACHE_DIR=/tmp/numba
RUN groupadd --gid 65532 agentserving && useradd --uid 65532 --gid 65532 --no-create-home agentserving
# The CPU build of torch, pinned (an unpinned torch would pull a multi-GB CUDA build).
RUN test -n "${TORCH_INDEX_URL}" || { echo "--build-arg TORCH_INDEX_URL=<an index with the CPU torch wheel> is required" >&2; exit 1; } \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}"
# lmcache's wheel requires CUDA-only packages; its CPU runtime deps are in the worker extra.
RUN pip install --no-cache-dir --no-deps "lmcache==${LMCACHE_VERSION}"
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/agentserving-*.whl)[worker]" && rm -rf /wheels
RUN mkdir -p /kvcache && chown 65532:65532 /kvcache
VOLUME /kvcache
USER 65532:65532
EXPOSE 8000 6999 7000
ENTRYPOINT ["agentserving"]
CMD ["worker", "--help"]
