# syntax=docker/dockerfile:1
# AgentServing image for the OpenAI-compatible proxy: `agentserving proxy`. No torch.
# Build from the repository root (BuildKit reads docker/proxy.Dockerfile.dockerignore):
#   docker build -f docker/proxy.Dockerfile -t agentserving/proxy:0.1.0 .
ARG PYTHON_IMAGE=python:3.11-slim-bookworm

FROM ${PYTHON_IMAGE} AS build
WORKDIR /src
RUN pip install --no-cache-dir "pip==25.3" "setuptools>=77.0.3,<81" wheel
COPY . .
RUN pip wheel --no-cache-dir --no-deps --no-build-isolation -w /wheels .

FROM ${PYTHON_IMAGE}
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1
RUN groupadd --gid 65532 agentserving && useradd --uid 65532 --gid 65532 --no-create-home agentserving
COPY --from=build /wheels /wheels
RUN pip install --no-cache-dir "$(ls /wheels/agentserving-*.whl)[proxy]" && rm -rf /wheels
USER 65532:65532
ENTRYPOINT ["agentserving"]
CMD ["proxy", "--help"]
