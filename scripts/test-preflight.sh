#!/usr/bin/env bash
# `make test`'s first step: refuse, in one line, a checkout that the tests' other users cannot reach.
# The suite runs cache clients as other uids and groups (tests/integration/cache, agent) with this
# checkout's interpreter and editable install; in a home directory closed to others (mode 0700) they
# fail deep inside a test with ModuleNotFoundError. Checked before anything is built.
set -euo pipefail
dir=$(pwd -P)
while [ "$dir" != / ]; do
  mode=$(stat -c %a "$dir")
  if (( (8#$mode & 1) == 0 )); then
    echo "make test: $dir (mode $mode) is closed to other users, and the tests run clients as other uids from this checkout: clone it where others may enter (e.g. /work or /tmp) or chmod o+x $dir" >&2
    exit 2
  fi
  dir=$(dirname "$dir")
done
