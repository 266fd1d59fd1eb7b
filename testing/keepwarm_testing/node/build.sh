#!/usr/bin/env bash
# Build the real node's container runtime pieces from their Go modules into a cache outside the repo,
# keyed by this file (the versions below); reuse them when present. The kubelet and kube-proxy come from
# the control plane's build (its go.mod pins Kubernetes), so every component shares one version.
#
#   testing/keepwarm_testing/node/build.sh          # prints the bin directory on its last line
#
# containerd (with its runc shim and `ctr`), runc (cgo, with seccomp: needs libseccomp-dev), the CNI
# plugins a node's bridge network uses, and crictl. Env: KEEPWARM_NODE_CACHE (default
# ~/.cache/keepwarm/node). A second concurrent call waits on a lock; an interrupted build resumes with the
# binaries it already finished (a changed version is a new key, so a new folder).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "build.sh: Go toolchain not found (need go >= 1.26 on PATH)" >&2; exit 1; }

# containerd 2.3 is the LTS line Kubernetes 1.37 supports (the kubelet needs containerd >= 2.0).
CONTAINERD=v2.3.7
RUNC=v1.4.4
CNI_PLUGINS=v1.9.1
CRI_TOOLS=v1.37.0
declare -A packages=(
  [containerd]=github.com/containerd/containerd/v2/cmd/containerd@$CONTAINERD
  [containerd-shim-runc-v2]=github.com/containerd/containerd/v2/cmd/containerd-shim-runc-v2@$CONTAINERD
  [ctr]=github.com/containerd/containerd/v2/cmd/ctr@$CONTAINERD
  [runc]=github.com/opencontainers/runc@$RUNC
  [bridge]=github.com/containernetworking/plugins/plugins/main/bridge@$CNI_PLUGINS
  [host-local]=github.com/containernetworking/plugins/plugins/ipam/host-local@$CNI_PLUGINS
  [loopback]=github.com/containernetworking/plugins/plugins/main/loopback@$CNI_PLUGINS
  [portmap]=github.com/containernetworking/plugins/plugins/meta/portmap@$CNI_PLUGINS
  [crictl]=sigs.k8s.io/cri-tools/cmd/crictl@$CRI_TOOLS
)
key="$(sha256sum "$here/build.sh" | cut -c1-16)"
root="${KEEPWARM_NODE_CACHE:-$HOME/.cache/keepwarm/node}/$key"
bin="$root/bin"
mkdir -p "$bin"
exec 9>"$root/.lock"
flock 9

missing=()
for name in "${!packages[@]}"; do [[ -x "$bin/$name" ]] || missing+=("$name"); done
if (( ${#missing[@]} == 0 )); then
  echo "node components cached in $bin" >&2
  echo "$bin"
  exit 0
fi
start=$SECONDS
export GOFLAGS="-buildvcs=false"
for name in "${missing[@]}"; do
  t0=$SECONDS
  echo "building $name (${packages[$name]})..." >&2
  tmp="$(mktemp -d)"
  cgo=0 tags=()
  if [[ "$name" == runc ]]; then cgo=1 tags=(-tags seccomp); fi  # runc applies seccomp through libseccomp
  GOBIN="$tmp" CGO_ENABLED=$cgo nice -n 19 go install -trimpath "${tags[@]}" -ldflags="-s -w" "${packages[$name]}"
  mv "$tmp/$(basename "${packages[$name]%@*}")" "$bin/$name"
  rm -rf "$tmp"
  echo "built $name in $((SECONDS - t0)) s" >&2
done
echo "node components built in $((SECONDS - start)) s into $bin" >&2
echo "$bin"
