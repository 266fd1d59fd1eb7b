# syntax=docker/dockerfile:1.7
# keepwarm images. Two targets:
#   docker build --target operator -t keepwarm-operator .   # kopf operator: slim, no torch
#   docker build --target runtime  -t keepwarm-runtime .    # node agent + inference server: CUDA
ARG PYTHON_IMAGE=python:3.11-slim-bookworm
ARG CUDA_IMAGE=nvidia/cuda:12.8.1-runtime-ubuntu24.04

# -- wheels: build the distributions once, install them without build tools below ----------------
FROM ${PYTHON_IMAGE} AS wheels
WORKDIR /src
COPY api/ api/
COPY runtime/ runtime/
COPY operator/ operator/
RUN pip wheel --no-cache-dir --no-deps -w /wheels ./api ./runtime ./operator

# -- operator: kopf, kubernetes client, pydantic, prometheus-client ------------------------------
FROM ${PYTHON_IMAGE} AS operator
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
COPY --from=wheels /wheels/keepwarm_api-*.whl /wheels/keepwarm_operator-*.whl /tmp/
RUN pip install /tmp/keepwarm_api-*.whl /tmp/keepwarm_operator-*.whl && rm /tmp/*.whl
# Non-root; the chart also sets runAsNonRoot and a read-only root filesystem.
USER 65532:65532
ENTRYPOINT ["keepwarm-operator"]
CMD ["run"]

# -- runtime: `keepwarm cache serve` (node agent) and `keepwarm serve` (inference) ----------------
FROM ${CUDA_IMAGE} AS runtime
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 \
    VIRTUAL_ENV=/opt/keepwarm PATH=/opt/keepwarm/bin:$PATH
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ffmpeg \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/keepwarm
COPY --from=wheels /wheels/keepwarm_api-*.whl /wheels/keepwarm_runtime-*.whl /tmp/
# All extras: GPU kernels, structured outputs, the node agent's kubernetes client, audio decoding.
RUN WHL=$(ls /tmp/keepwarm_runtime-*.whl) && pip install /tmp/keepwarm_api-*.whl "${WHL}[gpu,structured,kubernetes,audio]" \
 && rm /tmp/*.whl
# Inference pods run as this user (plus the cache's group); the agent DaemonSet runs as root with
# only CHOWN/FOWNER to create the shared socket directory.
RUN useradd --uid 1000 --create-home keepwarm
USER 1000:1000
EXPOSE 8000
ENTRYPOINT ["keepwarm"]
