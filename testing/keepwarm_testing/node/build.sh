#!/usr/bin/env bash
# Build the real node's container runtime pieces from their Go modules into a cache outside the repo,
# keyed by this file (the versions below); reuse them when present. The kubelet and kube-proxy come from
# the control plane's build (its go.mod pins Kubernetes), so every component shares one version.
#
#   testing/keepwarm_testing/node/build.sh          # prints the bin directory on its last line
#
# containerd (with its runc shim and `ctr`), runc (cgo, with seccomp: needs libseccomp-dev), the CNI
# plugins a node's bridge network uses, crictl, and the cluster's add-ons: CoreDNS (cluster DNS) and the
# LeaderWorkerSet controller (`lws-manager`, pinned by go.mod beside this file, its CRDs and webhook
# manifests copied from its module into lws/ beside bin/: node/addons.py installs them). Env:
# KEEPWARM_NODE_CACHE (default ~/.cache/keepwarm/node). A second concurrent call waits on a lock; an
# interrupted build resumes with the binaries it already finished (a changed version is a new key, so a
# new folder).
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "build.sh: Go toolchain not found (need go >= 1.26 on PATH)" >&2; exit 1; }

# containerd 2.3 is the LTS line Kubernetes 1.37 supports (the kubelet needs containerd >= 2.0).
CONTAINERD=v2.3.7
RUNC=v1.4.4
CNI_PLUGINS=v1.9.1
CRI_TOOLS=v1.37.0
COREDNS=v1.13.1
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
  [coredns]=github.com/coredns/coredns@$COREDNS
  [lws-manager]=sigs.k8s.io/lws/cmd  # a `tool` of go.mod: built in this folder, at go.mod's version
)
# What node/addons.py reads from the LWS module, relative to its root.
lws_files=(
  config/crd/bases/leaderworkerset.x-k8s.io_leaderworkersets.yaml
  config/crd/bases/disaggregatedset.x-k8s.io_disaggregatedsets.yaml
  config/webhook/manifests.yaml
  config/webhook/mutating-patch.yaml
  config/webhook/validating-patch.yaml
)
key="$(cat "$here/build.sh" "$here/go.mod" "$here/go.sum" | sha256sum | cut -c1-16)"
root="${KEEPWARM_NODE_CACHE:-$HOME/.cache/keepwarm/node}/$key"
bin="$root/bin"
mkdir -p "$bin"
exec 9>"$root/.lock"
flock 9

missing=()
for name in "${!packages[@]}"; do [[ -x "$bin/$name" ]] || missing+=("$name"); done
[[ -f "$root/lws/.complete" ]] || missing+=(lws-files)
if (( ${#missing[@]} == 0 )); then
  echo "node components cached in $bin" >&2
  echo "$bin"
  exit 0
fi
start=$SECONDS
export GOFLAGS="-buildvcs=false"
for name in "${missing[@]}"; do
  t0=$SECONDS
  if [[ "$name" == lws-files ]]; then
    src="$(cd "$here" && go mod download sigs.k8s.io/lws && go list -m -f '{{.Dir}}' sigs.k8s.io/lws)"
    mkdir -p "$root/lws"
    for f in "${lws_files[@]}"; do cp "$src/$f" "$root/lws/$(basename "$f")"; done
    touch "$root/lws/.complete"
    continue
  fi
  echo "building $name (${packages[$name]})..." >&2
  tmp="$(mktemp -d)"
  cgo=0 tags=()
  if [[ "$name" == runc ]]; then cgo=1 tags=(-tags seccomp); fi  # runc applies seccomp through libseccomp
  if [[ "${packages[$name]}" == *@* ]]; then
    GOBIN="$tmp" CGO_ENABLED=$cgo nice -n 19 go install -trimpath "${tags[@]}" -ldflags="-s -w" "${packages[$name]}"
  else
    (cd "$here" && CGO_ENABLED=$cgo nice -n 19 go build -trimpath -ldflags="-s -w" -o "$tmp/" "${packages[$name]}")
  fi
  built=("$tmp"/*)  # go install names it after the package's folder (lws's is `cmd`)
  mv "${built[0]}" "$bin/$name"
  rm -rf "$tmp"
  echo "built $name in $((SECONDS - t0)) s" >&2
done
echo "node components built in $((SECONDS - start)) s into $bin" >&2
echo "$bin"
