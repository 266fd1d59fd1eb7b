#!/usr/bin/env bash
# CRIU in keepwarm's runtime images (Dockerfile stages `criu`, `criu-cpu` and the runtimes that take
# them), so both runtimes carry the same CRIU as the tests (built by scripts/criu/build.sh, whose
# source is pinned by sha256), linked against their own base's libraries.
#
#   image.sh build DEST     # in a stage on the runtime's base: build CRIU into DEST, with this script
#                           # and DEST/runtime-packages (the Debian packages of the libraries it links)
#   image.sh install DEST   # in the runtime stage: install those packages and CRIU with the file
#                           # capabilities a pod's restore uses, then remove DEST
#
# The capabilities (CHECKPOINT_RESTORE, SETPCAP) are granted only where a pod adds them to its
# bounding set and allows privilege escalation; the node agent runs CRIU with an ambient capability
# instead. `criu --version` runs before setcap: a capability-aware exec fails (EPERM) wherever the
# bounding set lacks them, as in a build.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command="${1:?usage: image.sh build|install DEST}"
dest="${2:?usage: image.sh build|install DEST}"

case "$command" in
build)
  apt-get update
  # shellcheck disable=SC2046
  apt-get install -y --no-install-recommends $(bash "$here/build.sh" --build-deps)
  bin="$(KEEPWARM_CRIU_CACHE=/tmp/criu bash "$here/build.sh" | tail -1)"
  install -D -m 0755 "$bin/criu" "$dest/criu"
  install -m 0755 "$0" "$dest/image.sh"
  for lib in $(ldd "$dest/criu" | awk '$3 ~ /^\// {print $3}'); do
    real="$(realpath "$lib")"
    for path in "$lib" "$real" "${real#/usr}" "/usr$lib"; do dpkg -S "$path" 2>/dev/null && break; done
  done | cut -d: -f1 | sort -u >"$dest/runtime-packages"
  rm -rf /tmp/criu /var/lib/apt/lists/*
  ;;
install)
  apt-get update
  # shellcheck disable=SC2046
  apt-get install -y --no-install-recommends libcap2-bin $(cat "$dest/runtime-packages")
  install -m 0755 "$dest/criu" /usr/local/sbin/criu
  criu --version
  setcap cap_checkpoint_restore,cap_setpcap+ep /usr/local/sbin/criu
  rm -rf "$dest" /var/lib/apt/lists/*
  ;;
*)
  echo "image.sh: unknown command $command (build, install)" >&2
  exit 2
  ;;
esac
