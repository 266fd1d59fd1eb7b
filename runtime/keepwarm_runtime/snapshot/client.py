"""A runtime pod's two calls to the node agent's snapshot service (service.py), on SNAPSHOT_SOCKET in
the cache's socket directory: ask for a snapshot of this start's key, and report a restore (the
agent counts restores for status.snapshots[] and its LRU).

Both are one frame and one short answer (cache/protocol.py's framing) under a short timeout, made
by the launcher before it imports or after it restored: the agent answers at once and takes the
snapshot on its own time, so a pod's start never waits for one. Failures are logged and ignored: a
pod starts the same without an answer.

Protocol (requests carry ``cmd``; replies ``ok`` and, when false, ``error: {code, message}``):

* ``snapshot``: ``key`` (key.SnapshotKey's fields), ``config_json`` (the model's config.json, text),
  ``env`` (key.import_env of the pod's environment), optionally ``failed`` (what this pod's checks
  found wrong with the snapshot there: "digest", "manifest", "files") -> ``state``: "exists",
  "started" or "busy"
  (another snapshot is being taken); ``refused`` errors name why (another image, a bad request).
* ``restored``: ``key_digest`` -> ``counted``: true, or false for a snapshot the store lacks.

The agent takes the peer's uid, gid and groups from the kernel (SO_PEERCRED, SO_PEERGROUPS), never
from the request.
"""

from __future__ import annotations

import logging
import os
import socket
from pathlib import Path
from typing import Any

from keepwarm_api.sockets import SNAPSHOT_SOCKET
from keepwarm_runtime.cache.protocol import ProtocolError, recv_frame, send_frame
from keepwarm_runtime.snapshot.key import SnapshotKey, import_env

log = logging.getLogger(__name__)
MAX_REQUEST_BYTES = 2 << 20  # config.json and the import variables
TIMEOUT_S = 2.0


def call(socket_dir: str, request: dict[str, Any], timeout: float = TIMEOUT_S) -> dict[str, Any]:
    """One request to the snapshot service in ``socket_dir``; OSError or ProtocolError on failure."""
    path = Path(socket_dir) / SNAPSHOT_SOCKET
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(timeout)
        sock.connect(str(path))
        send_frame(sock, request)
        reply, fds = recv_frame(sock, MAX_REQUEST_BYTES, frame_timeout_s=timeout)
    for fd in fds:  # the service sends none
        os.close(fd)
    return reply


def ask_for_snapshot(
    socket_dir: str | None,
    key: SnapshotKey,
    config_json: bytes,
    environ: dict[str, str],
    failed: str | None = None,
) -> None:
    """Ask the agent to take a snapshot for ``key`` (when none exists, or when the one there ``failed``
    this pod's checks: "digest", "manifest" or "files"); logs the answer."""
    if socket_dir is None:
        return
    request = {
        "cmd": "snapshot",
        "key": key.wire(),
        "config_json": config_json.decode("utf-8", errors="replace"),
        "env": import_env(environ),
        **({"failed": failed} if failed is not None else {}),
    }
    try:
        reply = call(socket_dir, request)
    except (OSError, ProtocolError) as exc:
        log.info("snapshots: the node agent's snapshot service did not answer (%s)", exc)
        return
    if reply.get("ok"):
        log.info("snapshots: asked the node agent for snapshot %s: %s", key.digest(), reply.get("state"))
    else:
        error = reply.get("error") or {}
        log.warning("snapshots: the node agent will not take one: %s", error.get("message", reply))


def report_restore(socket_dir: str | None, key_digest: str) -> None:
    """Tell the agent this pod restored ``key_digest``."""
    if socket_dir is None:
        return
    try:
        call(socket_dir, {"cmd": "restored", "key_digest": key_digest})
    except (OSError, ProtocolError) as exc:
        log.info("snapshots: could not report the restore to the node agent (%s)", exc)
