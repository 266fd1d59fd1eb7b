#!/usr/bin/env bash
# Build the Dockerfile's targets without a Docker engine or a registry: buildah (Debian package) from a
# base image made locally with debootstrap. For machines that reach only package registries.
#
#   sudo scripts/buildah-local.sh operator      # or: runtime
#
# The local base is Debian bookworm with python3/pip (standing in for python:*-slim) and a user
# `ubuntu` with uid 1000 (as the nvidia/cuda:*-ubuntu24.04 bases have), so the runtime user's uid is
# checked against the same collision. The host's CA bundle is mounted into RUN steps, for networks
# that intercept TLS. The runtime target also needs FlashInfer's own wheel index
# (FLASHINFER_JIT_CACHE_INDEX): without it, pip stops at flashinfer-jit-cache.
set -euo pipefail
target="${1:?usage: buildah-local.sh operator|runtime}"
repo="$(cd "$(dirname "$0")/.." && pwd)"
work="${KEEPWARM_BUILDAH_DIR:-/tmp/keepwarm-buildah}"
base=localhost/keepwarm-base:bookworm
mkdir -p "$work"

if ! buildah inspect "$base" >/dev/null 2>&1; then
  if [[ ! -x "$work/rootfs/usr/bin/python3" ]]; then
    debootstrap --variant=minbase --include=python3,python3-venv,python3-pip,ca-certificates \
      bookworm "$work/rootfs" http://deb.debian.org/debian
  fi
  rm -f "$work"/rootfs/usr/lib/python3*/EXTERNALLY-MANAGED   # pip installs system-wide, as in python:*-slim
  chroot "$work/rootfs" sh -c 'id ubuntu >/dev/null 2>&1 || useradd --uid 1000 --create-home ubuntu'
  ctr="$(buildah from scratch)"
  cp -a "$work/rootfs/." "$(buildah mount "$ctr")/"
  buildah config --env PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin "$ctr"
  buildah commit "$ctr" "$base"
  buildah rm "$ctr"
fi

buildah bud --isolation chroot --volume /etc/ssl/certs:/etc/ssl/certs:ro --target "$target" \
  --build-arg PYTHON_IMAGE="$base" --build-arg CUDA_IMAGE="$base" \
  --build-arg VCS_REF="$(git -C "$repo" rev-parse --short HEAD)" \
  --build-arg BUILD_DATE="$(date -u +%Y-%m-%dT%H:%M:%SZ)" \
  -t "localhost/keepwarm-$target:local" "$repo"
