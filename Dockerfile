# syntax=docker/dockerfile:1.7
# keepwarm images. Three targets; the operator and the runtimes each have their own wheel stage (a
# runtime change never rebuilds the operator image, and the reverse):
#   docker build --target operator    -t keepwarm-operator .     # kopf operator: slim, no torch
#   docker build --target runtime     -t keepwarm-runtime .      # node agent + inference server: CUDA
#   docker build --target runtime-cpu -t keepwarm-runtime-cpu .  # the same on CPU nodes: torch's CPU build
#
# Every Python environment is a venv at /opt/keepwarm, so any base with python3 and its venv module works
# (the official python images, Debian's python3 + python3-venv, Ubuntu's): the tests build these targets
# with buildah from a Debian root of their own (testing/keepwarm_testing/node/images.py), since no image
# registry is reachable there.
#
# Every version is a build argument; tests/unit/delivery/test_dockerfile.py checks them against the
# pyproject files. Why a CUDA `-base` image and not `-runtime` (or none): torch's wheel ships its own
# CUDA user-space libraries (cudart, cuBLAS, cuDNN, NCCL, NVRTC as nvidia-* wheels pinned to the CUDA
# it was built for), so a `-runtime` base would add a second, unused CUDA of several GB. `-base` adds
# only what the NVIDIA container toolkit reads (NVIDIA_VISIBLE_DEVICES, NVIDIA_DRIVER_CAPABILITIES and
# NVIDIA_REQUIRE_CUDA, which refuses a driver too old for this CUDA at start instead of at the first
# kernel); a plain Ubuntu base would have to restate those by hand. Keep CUDA_VERSION equal to the CUDA
# of the pinned torch wheel (torch 2.15.0 on PyPI is built for CUDA 13.2).
ARG PYTHON_IMAGE=python:3.12-slim-bookworm
# The CPU runtime's base: any Debian or Ubuntu image whose apt has python3, python3-venv and ffmpeg.
ARG DEBIAN_IMAGE=debian:bookworm-20251117-slim
ARG CUDA_VERSION=13.2.0
ARG UBUNTU_VERSION=24.04
ARG CUDA_IMAGE=nvidia/cuda:${CUDA_VERSION}-base-ubuntu${UBUNTU_VERSION}
ARG KEEPWARM_VERSION=0.1.0
ARG TORCH_VERSION=2.15.0
# FlashInfer's prebuilt kernels: flashinfer-cubin (PyPI) and flashinfer-jit-cache (FlashInfer's own
# index, one per CUDA major), so no kernel is compiled at first use (the image has no nvcc).
ARG FLASHINFER_VERSION=0.6.13
ARG FLASHINFER_JIT_CACHE_INDEX=https://flashinfer.ai/whl/cu130
# torch's CPU build (no CUDA libraries) for runtime-cpu; empty takes torch from the default index.
ARG TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ARG UV_VERSION=0.13.9
ARG VCS_REF=unknown
ARG BUILD_DATE=unknown

# -- wheels: one stage per distribution ----------------------------------------------------------
FROM ${PYTHON_IMAGE} AS operator-wheel
WORKDIR /src
COPY api/ api/
COPY operator/ operator/
RUN python3 -m venv /opt/build && /opt/build/bin/pip wheel --no-cache-dir --no-deps -w /wheels ./api ./operator

FROM ${PYTHON_IMAGE} AS runtime-wheel
WORKDIR /src
COPY api/ api/
COPY runtime/ runtime/
RUN python3 -m venv /opt/build && /opt/build/bin/pip wheel --no-cache-dir --no-deps -w /wheels ./api ./runtime

# -- operator: kopf, kubernetes client, pydantic, prometheus-client ------------------------------
FROM ${PYTHON_IMAGE} AS operator
ARG KEEPWARM_VERSION
ARG VCS_REF
ARG BUILD_DATE
LABEL org.opencontainers.image.title="keepwarm-operator" \
      org.opencontainers.image.description="keepwarm Kubernetes operator: WeightCache and InferenceDeployment" \
      org.opencontainers.image.version="${KEEPWARM_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.source="https://github.com/keepwarm/keepwarm"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/keepwarm PATH=/opt/keepwarm/bin:$PATH
COPY --from=operator-wheel /wheels/ /tmp/wheels/
RUN python3 -m venv /opt/keepwarm \
 && pip install "/tmp/wheels/keepwarm_api-${KEEPWARM_VERSION}-py3-none-any.whl" \
      "/tmp/wheels/keepwarm_operator-${KEEPWARM_VERSION}-py3-none-any.whl" \
 && rm -rf /tmp/wheels
# Non-root, a uid no Debian base user has; the chart also sets runAsNonRoot and a read-only root.
USER 65532:65532
ENTRYPOINT ["keepwarm-operator"]
CMD ["run"]

# -- criu, criu-cpu: CRIU for process snapshots (docs/snapshots.md) -------------------------------
# Built by the script that builds it for the tests (scripts/criu/build.sh: Debian's upstream tarball of
# CRIU, pinned by sha256), on each runtime's own base so the binary links the libraries that base has;
# scripts/criu/image.sh also lists the packages of those libraries, which the runtime stage installs.
FROM ${CUDA_IMAGE} AS criu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY scripts/criu/ /src/criu/
RUN bash /src/criu/image.sh build /opt/criu

FROM ${DEBIAN_IMAGE} AS criu-cpu
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
COPY scripts/criu/ /src/criu/
RUN bash /src/criu/image.sh build /opt/criu

# -- runtime: `keepwarm cache serve` (node agent) and `keepwarm serve` (inference) ----------------
FROM ${CUDA_IMAGE} AS runtime
ARG KEEPWARM_VERSION
ARG TORCH_VERSION
ARG FLASHINFER_VERSION
ARG FLASHINFER_JIT_CACHE_INDEX
ARG VCS_REF
ARG BUILD_DATE
LABEL org.opencontainers.image.title="keepwarm-runtime" \
      org.opencontainers.image.description="keepwarm node weight cache, inference engine and OpenAI-compatible server" \
      org.opencontainers.image.version="${KEEPWARM_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.source="https://github.com/keepwarm/keepwarm"
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/keepwarm PATH=/opt/keepwarm/bin:$PATH
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# Ubuntu's python3 and FFmpeg (torchcodec's decoder); versions follow the pinned Ubuntu release.
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ffmpeg \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/keepwarm
# Before the heavy layers, so it stays cached. The CUDA Ubuntu base already has user `ubuntu` with
# uid/gid 1000: keepwarm gets 10001, which no base user holds. Inference pods run as this user (plus
# the cache's group); the agent DaemonSet runs as root with only CHOWN/FOWNER for the socket dir.
RUN groupadd --gid 10001 keepwarm \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin keepwarm
COPY --from=runtime-wheel /wheels/ /tmp/wheels/
# torch first and pinned, so the extras' resolver can never swap in another CUDA build; then all
# extras (FlashInfer kernels, structured outputs, the agent's kubernetes client, audio decoding).
RUN pip install "torch==${TORCH_VERSION}" \
 && pip install --extra-index-url "${FLASHINFER_JIT_CACHE_INDEX}" \
      "torch==${TORCH_VERSION}" \
      "flashinfer-python==${FLASHINFER_VERSION}" \
      "flashinfer-cubin==${FLASHINFER_VERSION}" \
      "flashinfer-jit-cache==${FLASHINFER_VERSION}" \
      "/tmp/wheels/keepwarm_api-${KEEPWARM_VERSION}-py3-none-any.whl" \
      "/tmp/wheels/keepwarm_runtime-${KEEPWARM_VERSION}-py3-none-any.whl[gpu,structured,kubernetes,audio]" \
 && rm -rf /tmp/wheels
# CRIU, with the file capabilities a runtime pod's restore uses (scripts/criu/image.sh).
COPY --from=criu /opt/criu/ /opt/criu/
RUN bash /opt/criu/image.sh install /opt/criu
USER 10001:10001
WORKDIR /home/keepwarm
EXPOSE 8000
ENTRYPOINT ["keepwarm"]

# -- runtime-cpu: the runtime for CPU nodes (and the tests' real node) ----------------------------
FROM ${DEBIAN_IMAGE} AS runtime-cpu
ARG KEEPWARM_VERSION
ARG TORCH_VERSION
ARG TORCH_CPU_INDEX
ARG UV_VERSION
ARG VCS_REF
ARG BUILD_DATE
LABEL org.opencontainers.image.title="keepwarm-runtime-cpu" \
      org.opencontainers.image.description="keepwarm node weight cache, inference engine and OpenAI-compatible server, CPU build" \
      org.opencontainers.image.version="${KEEPWARM_VERSION}" \
      org.opencontainers.image.revision="${VCS_REF}" \
      org.opencontainers.image.created="${BUILD_DATE}" \
      org.opencontainers.image.source="https://github.com/keepwarm/keepwarm"
# UV_COMPILE_BYTECODE: uv, unlike pip, installs no bytecode, and a process that may not write it
# (PYTHONDONTWRITEBYTECODE, a read-only root) would compile every module again at each start: on the
# tests' real node that was a minute of imports per pod.
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 \
    VIRTUAL_ENV=/opt/keepwarm PATH=/opt/keepwarm/bin:$PATH UV_LINK_MODE=copy UV_COMPILE_BYTECODE=1
SHELL ["/bin/bash", "-o", "pipefail", "-c"]
# hadolint ignore=DL3008
RUN apt-get update \
 && apt-get install -y --no-install-recommends python3 python3-venv ffmpeg \
 && rm -rf /var/lib/apt/lists/* \
 && python3 -m venv /opt/keepwarm \
 && pip install "uv==${UV_VERSION}"
RUN groupadd --gid 10001 keepwarm \
 && useradd --uid 10001 --gid 10001 --create-home --shell /usr/sbin/nologin keepwarm
# CRIU, as in the GPU runtime (scripts/criu/image.sh); before the heavy layers, so it stays cached.
COPY --from=criu-cpu /opt/criu/ /opt/criu/
RUN bash /opt/criu/image.sh install /opt/criu
# The third-party packages come from the pyproject files alone, before keepwarm's own wheels, so a change
# to keepwarm's code rebuilds (and a node pulls) only the last, small layer. torch first and pinned, from
# its CPU index; then the runtime's dependencies and CPU extras (keepwarm's own packages left out here).
COPY api/pyproject.toml /tmp/dist/api/pyproject.toml
COPY runtime/pyproject.toml /tmp/dist/runtime/pyproject.toml
RUN --mount=type=cache,target=/root/.cache/uv \
    uv pip install ${TORCH_CPU_INDEX:+--index-url "$TORCH_CPU_INDEX" --extra-index-url https://pypi.org/simple} \
      "torch==${TORCH_VERSION}" \
 && python3 -c 'import sys, tomllib; \
    dists = [tomllib.load(open(f"/tmp/dist/{d}/pyproject.toml", "rb"))["project"] for d in ("api", "runtime")]; \
    extras = ("structured", "kubernetes", "audio-cpu"); \
    reqs = [r for p in dists for r in p["dependencies"] + [x for e in extras for x in p.get("optional-dependencies", {}).get(e, [])]]; \
    print("\n".join(r for r in reqs if not r.startswith("keepwarm")))' > /tmp/dist/requirements.txt \
 && uv pip install -r /tmp/dist/requirements.txt \
 && rm -rf /tmp/dist
COPY --from=runtime-wheel /wheels/ /tmp/wheels/
RUN uv pip install --no-deps "/tmp/wheels/keepwarm_api-${KEEPWARM_VERSION}-py3-none-any.whl" \
      "/tmp/wheels/keepwarm_runtime-${KEEPWARM_VERSION}-py3-none-any.whl" \
 && rm -rf /tmp/wheels
USER 10001:10001
WORKDIR /home/keepwarm
EXPOSE 8000
ENTRYPOINT ["keepwarm"]
