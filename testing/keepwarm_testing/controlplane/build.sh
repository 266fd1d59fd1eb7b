#!/usr/bin/env bash
# Build the real control plane (etcd, kube-apiserver, kube-controller-manager, kube-scheduler,
# kubectl) and the node's Kubernetes agents (kubelet, kube-proxy) pinned in go.mod into a cache outside
# the repo, keyed by version; reuse it when present.
#
#   testing/keepwarm_testing/controlplane/build.sh          # prints the bin directory on its last line
#
# Env: KEEPWARM_CONTROLPLANE_CACHE (default ~/.cache/keepwarm/controlplane). Needs only Go and the
# Go module proxy. A second concurrent call waits on a lock instead of building twice; an
# interrupted build resumes with the binaries it already finished.
set -euo pipefail
here="$(cd "$(dirname "$0")" && pwd)"
# A non-login shell (CI) may miss the toolchain's usual PATH entry.
command -v go >/dev/null || export PATH="$PATH:/usr/local/go/bin"
command -v go >/dev/null || { echo "build.sh: Go toolchain not found (need go >= 1.26 on PATH)" >&2; exit 1; }
cd "$here"

kube_version="$(awk '$1 == "k8s.io/kubernetes" && $2 ~ /^v/ {print $2; exit}' go.mod)"
etcd_version="$(awk '$1 == "go.etcd.io/etcd/server/v3" && $2 ~ /^v/ {print $2; exit}' go.mod)"
root="${KEEPWARM_CONTROLPLANE_CACHE:-$HOME/.cache/keepwarm/controlplane}/${kube_version}"
bin="$root/bin"
# go.mod + go.sum pin the build exactly: a changed pin throws the cached binaries away.
key="$(cat go.mod go.sum | sha256sum | cut -c1-16)"
mkdir -p "$bin"

exec 9>"$root/.lock"
flock 9

names=(etcd kube-apiserver kube-controller-manager kube-scheduler kubectl kubelet kube-proxy)
missing=()
for name in "${names[@]}"; do [[ -x "$bin/$name" ]] || missing+=("$name"); done
if [[ "$(cat "$bin/.key" 2>/dev/null)" == "$key" && ${#missing[@]} == 0 ]]; then
  echo "control plane $kube_version (etcd $etcd_version) cached in $bin" >&2
  echo "$bin"
  exit 0
fi
# The binaries built from other pins are thrown away; with the same pins only the missing ones build.
if [[ "$(cat "$bin/.key" 2>/dev/null || cat "$bin/.partial" 2>/dev/null)" != "$key" ]]; then
  find "$bin" -mindepth 1 -delete
  missing=("${names[@]}")
fi
rm -f "$bin/.key"
echo "$key" >"$bin/.partial"

# Version stamps so /version, `kubectl version` and clients see the release, not v0.0.0-master.
minor="$(echo "$kube_version" | cut -d. -f2)"
stamp=""
for pkg in k8s.io/component-base/version k8s.io/client-go/pkg/version; do
  stamp+=" -X $pkg.gitVersion=$kube_version -X $pkg.gitMajor=1 -X $pkg.gitMinor=$minor"
  stamp+=" -X $pkg.gitTreeState=clean -X $pkg.buildDate=1970-01-01T00:00:00Z"
done

export CGO_ENABLED=0 GOFLAGS="-mod=mod -buildvcs=false"
declare -A targets=(
  [etcd]=go.etcd.io/etcd/server/v3
  [kube-apiserver]=k8s.io/kubernetes/cmd/kube-apiserver
  [kube-controller-manager]=k8s.io/kubernetes/cmd/kube-controller-manager
  [kube-scheduler]=k8s.io/kubernetes/cmd/kube-scheduler
  [kubectl]=k8s.io/kubernetes/cmd/kubectl
  [kubelet]=k8s.io/kubernetes/cmd/kubelet
  [kube-proxy]=k8s.io/kubernetes/cmd/kube-proxy
)
start=$SECONDS
for name in "${missing[@]}"; do
  t0=$SECONDS
  echo "building $name (${targets[$name]})..." >&2
  nice -n 19 go build -trimpath -ldflags="-s -w$stamp" -o "$bin/$name.tmp" "${targets[$name]}"
  mv "$bin/$name.tmp" "$bin/$name"
  echo "built $name in $((SECONDS - t0)) s" >&2
done
mv "$bin/.partial" "$bin/.key"
echo "control plane $kube_version (etcd $etcd_version) built in $((SECONDS - start)) s into $bin" >&2
echo "$bin"
