#!/usr/bin/env bash
# Build CRIU (process checkpoint/restore, for keepwarm's process snapshots: docs/snapshots.md) from
# Debian's source of it into a cache outside the repo, keyed by version; reuse it when present.
#
#   scripts/criu/build.sh                 # prints the directory holding `criu` on its last line
#   scripts/criu/build.sh --build-deps    # prints the Debian packages the build needs, one a line
#
# The source is Debian trixie's upstream tarball of CRIU (criu_<version>.orig.tar.xz, the file
# Debian's signed Sources index lists), fetched from deb.debian.org and checked against the sha256
# pinned below: the same bytes on a developer machine, in CI and in the runtime image's build stage
# (Dockerfile, stage `criu`), whatever the base. Why not bookworm's criu package: 3.17 fails
# `criu check` on recent kernels (vdso); 4.x passes.
#
# Env: KEEPWARM_CRIU_CACHE (default ~/.cache/keepwarm/criu). A second concurrent call waits on a
# lock instead of building twice; an interrupted build starts again from the checked tarball.
set -euo pipefail

version=4.1.1
tarball="criu_${version}.orig.tar.xz"
sha256=f80a66cb3726bb2116266d4759ce3bcbfab7abdb6b6d430bf20dd41911717afe
url="http://deb.debian.org/debian/pool/main/c/criu/${tarball}"
# What `make criu` needs (Debian and Ubuntu names): a C toolchain, protobuf-c (and protobuf's
# descriptor.proto, from libprotobuf-dev) and the libraries CRIU links.
build_deps=(gcc make pkg-config xz-utils curl ca-certificates libprotobuf-c-dev protobuf-c-compiler
  libprotobuf-dev libnl-3-dev libnet1-dev libcap-dev libbsd-dev libgnutls28-dev uuid-dev libnftables-dev libdrm-dev)

if [[ "${1:-}" == "--build-deps" ]]; then
  printf '%s\n' "${build_deps[@]}"
  exit 0
fi

root="${KEEPWARM_CRIU_CACHE:-$HOME/.cache/keepwarm/criu}/${version}"
bin="$root/bin"
mkdir -p "$root"
exec 9>"$root/.lock"
flock 9

if [[ -x "$bin/criu" && "$(cat "$bin/.sha256" 2>/dev/null)" == "$sha256" ]]; then
  echo "criu $version cached in $bin" >&2
  echo "$bin"
  exit 0
fi

start=$SECONDS
work="$root/build"
rm -rf "$work" "$bin"
mkdir -p "$work"
if [[ "$(sha256sum "$root/$tarball" 2>/dev/null | cut -d' ' -f1)" != "$sha256" ]]; then
  echo "fetching $url..." >&2
  curl -fsSL --retry 3 -o "$root/$tarball.tmp" "$url"
  mv "$root/$tarball.tmp" "$root/$tarball"
fi
echo "$sha256  $root/$tarball" | sha256sum -c --quiet - || {
  echo "build.sh: $tarball does not match its pinned sha256 ($sha256)" >&2
  rm -f "$root/$tarball"
  exit 1
}
tar -xJf "$root/$tarball" -C "$work" --strip-components=1
echo "building criu $version..." >&2
# Only the binary: no docs (asciidoc), no Python bindings, no crit.
nice -n 10 make -C "$work" -j"$(nproc)" criu >"$root/build.log" 2>&1 || {
  tail -40 "$root/build.log" >&2
  echo "build.sh: make criu failed (full log $root/build.log); the packages it needs: $0 --build-deps" >&2
  exit 1
}
mkdir -p "$bin.tmp"
install -m 0755 "$work/criu/criu" "$bin.tmp/criu"
echo "$sha256" >"$bin.tmp/.sha256"
mv "$bin.tmp" "$bin"
rm -rf "$work"
echo "criu $version built in $((SECONDS - start)) s into $bin" >&2
echo "$bin"
