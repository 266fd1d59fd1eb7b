"""Hand-off between daemons on one socket: the running daemon gives its successor its arenas, its
listening socket and its lock, so that the node never goes cold during an upgrade.

The conversation, on one connection to the socket (``protocol.py`` framing)::

    successor -> running    {"cmd": "handoff", "formats": [1]}
    running   -> successor  a stream (handoff.py): every arena record + fd, then the listener + lock fds
                            (it keeps serving meanwhile)
    successor               verifies each arena (adopt.py), loads from disk what it still lacks
    successor -> running    {"cmd": "commit"}
    running   -> successor  {"ok": true, "committed": true}; it stops accepting, lets its open
                            connections finish, and exits without unlinking the socket

Only the daemon's own uid may ask (SO_PEERCRED, as every connection is checked): an allowed client
uid is refused by name. A record format the other side does not read is refused by name and the
stream carries no arenas, only the listener and the lock: the successor then loads from disk
while the running daemon keeps serving, and commits when it is ready.

The listener travels (as Envoy's hot restart passes its sockets) so that no connection is ever
refused: clients queue in the one backlog whoever accepts. The lock's open file description
travels too, so the lock is never free for a third daemon to grab. If the successor dies before it
commits, its copies of the descriptors die with it and the running daemon carries on; if the
running daemon dies first, the successor finds the lock free and starts as after a crash.

Each side counts its hand-offs by outcome in ``keepwarm_cache_handoffs_total`` (metrics.py).
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import time
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from keepwarm_runtime.cache import protocol, security
from keepwarm_runtime.cache.adopt import Adoption, adopt, refuse
from keepwarm_runtime.cache.handoff import (
    READABLE_FORMATS,
    RECORD_FORMAT,
    HandoffRefused,
    check_format,
    record_of,
    recv_stream,
    send_stream,
)
from keepwarm_runtime.cache.metrics import (
    ABANDONED,
    COMMITTED,
    PREDECESSOR,
    REFUSED,
    SUCCESSOR,
    UNCONFIRMED,
)

if TYPE_CHECKING:
    from keepwarm_runtime.cache.core import DaemonCore

log = logging.getLogger(__name__)
COMMIT_TIMEOUT_S = 30.0  # the successor waits this long for "committed", then for the lock itself
RETRY_S = 0.2  # between attempts while the running daemon is still starting or briefly unreachable
SEND_TIMEOUT_S = 30.0  # a frame of the stream into a successor that does not read
MAX_ATTEMPTS = 50  # failed hand-offs to a daemon that holds the lock before the successor gives up


class Refused(HandoffRefused):
    """The running daemon refused for good (another uid, or it is handing off already)."""


@dataclass
class Inheritance:
    """What a successor holds between the stream and the commit."""

    sock: socket.socket  # the connection to the predecessor, open until the commit
    listener_fd: int
    lock_fd: int
    pid: int  # the predecessor's (in this pid namespace; 0 when it is another pod's)
    adoption: Adoption


def config_summary(daemon: DaemonCore) -> dict[str, Any]:
    """The settings a successor compares with its own (and logs the differences of)."""
    c = daemon.config
    return {
        "tier": daemon.tier,
        "gpu_uuid": daemon.gpu_uuid,
        "dtype": c.dtype,
        "budget": c.budget,
        "expert_layout": c.expert_layout,
        "quantization": c.quantization,
        "allow_uids": sorted(c.allow_uids),
        "allow_gids": sorted(c.allow_gids),
    }


# -- the running daemon ---------------------------------------------------------------------------


def give(daemon: DaemonCore, conn: socket.socket, cred: security.PeerCred, request: dict[str, Any]) -> None:
    """Answer a ``handoff`` request on ``conn``: refuse it by name, or stream everything and, on the
    successor's commit, stop accepting (``daemon.hand_over``)."""
    conn.settimeout(SEND_TIMEOUT_S)
    if cred.uid != daemon.policy.uid:
        daemon.metrics.refused_peers.inc()
        why = f"hand-off is for the daemon's own uid {daemon.policy.uid}; uid {cred.uid} is a client"
        log.warning("refused a hand-off request from pid=%d: %s", cred.pid, why)
        _refuse(daemon, conn, "forbidden", why)
        return
    formats = request.get("formats")
    if not isinstance(formats, list) or not all(type(f) is int for f in formats) or len(formats) > 64:
        _refuse(daemon, conn, "bad_request", "handoff: 'formats' must list integers")
        return
    if daemon.stopping or not daemon.handing_off.acquire(blocking=False):
        _refuse(daemon, conn, "busy", "this daemon is stopping or handing off already")
        return
    try:
        _stream_and_wait(daemon, conn, cred, formats)
    finally:
        daemon.handing_off.release()


def _refuse(daemon: DaemonCore, conn: socket.socket, code: str, why: str) -> None:
    daemon.metrics.handoffs.labels(PREDECESSOR, REFUSED).inc()
    protocol.send_frame(conn, protocol.error_reply(code, why))


def _stream_and_wait(
    daemon: DaemonCore, conn: socket.socket, cred: security.PeerCred, formats: list[int]
) -> None:
    head: dict[str, Any] = {
        "format": RECORD_FORMAT,
        "pid": os.getpid(),
        "version": daemon.snapshot().version,
        "config": config_summary(daemon),
    }
    items: list[tuple[dict[str, Any], int]] = []
    if RECORD_FORMAT in formats:
        now = time.monotonic()
        for model in daemon.registry.models():
            with contextlib.suppress(OSError):  # dropped meanwhile: it is simply not handed over
                items.append((record_of(model, now).to_wire(), os.dup(model.arena.fd)))
    else:
        head["refused"] = (
            f"this daemon writes arena record format {RECORD_FORMAT}; the successor reads {formats}"
        )
        log.warning("hand-off to pid=%d without arenas: %s", cred.pid, head["refused"])
    try:
        send_stream(conn, head, items, daemon.handoff_fds())
    except OSError as exc:  # the successor went away (or stopped reading) during the stream
        _abandoned(daemon, cred, f"the stream failed: {exc}")
        return
    finally:
        for _, fd in items:
            os.close(fd)
    log.info("handed %d arenas to pid=%d; serving until it commits", len(items), cred.pid)
    conn.settimeout(None)  # the successor may load from disk before it commits
    try:
        request, fds = protocol.recv_frame(conn, protocol.MAX_REQUEST_BYTES)
    except (protocol.ProtocolError, OSError) as exc:
        _abandoned(daemon, cred, str(exc))
        return
    for fd in fds:
        os.close(fd)
    if request.get("cmd") != "commit":
        _abandoned(daemon, cred, f"it sent {request.get('cmd')!r}")
        return
    daemon.metrics.handoffs.labels(PREDECESSOR, COMMITTED).inc()
    daemon.hand_over()
    conn.settimeout(SEND_TIMEOUT_S)
    with contextlib.suppress(OSError):
        protocol.send_frame(conn, {"ok": True, "committed": True})
    log.info("committed the hand-off to pid=%d: no longer accepting; draining", cred.pid)


def _abandoned(daemon: DaemonCore, cred: security.PeerCred, why: str) -> None:
    daemon.metrics.handoffs.labels(PREDECESSOR, ABANDONED).inc()
    log.warning("hand-off to pid=%d abandoned (%s); still serving", cred.pid, why)


# -- the successor --------------------------------------------------------------------------------


def _ask(daemon: DaemonCore) -> Inheritance:
    """One hand-off request; raises Refused (give up), or OSError/ProtocolError/HandoffRefused (retry).

    The predecessor must run as this daemon's uid (checked below), so its socket trusts no owner
    beyond this uid and root."""
    security.check_client_path(daemon.socket_path)
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(10.0)
        sock.connect(str(daemon.socket_path))
        cred = security.peer_cred(sock)
        if cred.uid != os.geteuid():
            why = f"the daemon behind {daemon.socket_path} runs as uid {cred.uid}, not {os.geteuid()}"
            raise Refused(why)
        protocol.send_frame(sock, {"cmd": "handoff", "formats": list(READABLE_FORMATS)})
        try:
            stream = recv_stream(sock)
        except HandoffRefused as exc:
            if str(exc).startswith(("forbidden", "bad_request")):
                raise Refused(str(exc)) from None
            raise
    except BaseException:
        sock.close()
        raise
    try:
        if len(stream.final_fds) != 2:
            raise HandoffRefused(f"the stream ended with {len(stream.final_fds)} descriptors, not 2")
        who = f"pid {stream.head.get('pid')}"
        _log_config_changes(daemon, stream.head.get("config"))
        try:
            if stream.head.get("refused"):
                raise HandoffRefused(str(stream.head["refused"])[:300])
            check_format(stream.head)
            adoption = adopt(daemon, stream, PREDECESSOR, who)
        except HandoffRefused as exc:
            refuse(daemon, stream, PREDECESSOR)
            log.warning("taking no arenas from the predecessor %s: %s; loading from disk instead", who, exc)
            adoption = Adoption([], {}, 0.0)
        listener_fd, lock_fd = stream.final_fds
        stream.final_fds = []
    finally:
        stream.close()
    return Inheritance(sock, listener_fd, lock_fd, cred.pid, adoption)


def _log_config_changes(daemon: DaemonCore, theirs: Any) -> None:
    if not isinstance(theirs, dict):
        return
    mine = config_summary(daemon)
    changes = [f"{k} {theirs.get(k)} -> {v}" for k, v in mine.items() if theirs.get(k) != v]
    if changes:
        log.info("configuration changes at hand-off: %s", "; ".join(changes))


def take_over(daemon: DaemonCore, busy: security.DaemonAlreadyRunning) -> Inheritance | None:
    """The lock is held: ask its holder for everything. Returns None when the lock became free (the
    running daemon died, or stopped: the caller then holds the lock and starts as after a crash). A
    daemon from before hand-offs (``unknown_command``) is waited for: it keeps serving until it is
    stopped, and this one then loads as daemons did before."""
    attempts, waiting_logged, legacy = 0, False, False
    while True:
        if daemon.socket_path.exists() and not legacy:
            try:
                return _ask(daemon)
            except Refused as exc:
                raise security.DaemonAlreadyRunning(f"{busy}; it refused to hand off: {exc}") from None
            except (OSError, protocol.ProtocolError, HandoffRefused, security.CacheSecurityError) as exc:
                if str(exc).startswith("unknown_command"):  # a keepwarm from before hand-offs
                    log.warning("%s, a version without hand-off; waiting for it to stop, then loading", busy)
                    legacy = True
                    continue
                attempts += 1
                if attempts >= MAX_ATTEMPTS:
                    raise security.DaemonAlreadyRunning(f"{busy}; hand-off failed: {exc}") from None
                log.info("hand-off attempt %d failed (%s); retrying", attempts, exc)
        elif not waiting_logged and not legacy:
            log.info("%s; waiting for it to bind its socket, then taking over", busy)
            waiting_logged = True
        time.sleep(RETRY_S)
        with contextlib.suppress(security.DaemonAlreadyRunning):
            daemon.lock.acquire()
            return None


def commit(daemon: DaemonCore, inheritance: Inheritance) -> None:
    """Tell the predecessor to stop; the listener and lock are then ours. If it does not confirm,
    serve only once the lock is ours alone (it exited); otherwise give everything back and fail."""
    sock = inheritance.sock
    try:
        sock.settimeout(COMMIT_TIMEOUT_S)
        protocol.send_frame(sock, {"cmd": "commit"})
        reply, fds = protocol.recv_frame(sock)
        for fd in fds:
            os.close(fd)
        if reply.get("committed") is True:
            daemon.lock.adopt(inheritance.lock_fd)
            daemon.metrics.handoffs.labels(SUCCESSOR, COMMITTED).inc()
            log.info("took over from pid %d", inheritance.pid)
            return
        why = f"it answered {str(reply)[:200]}"
    except (OSError, protocol.ProtocolError) as exc:
        why = str(exc)
    finally:
        sock.close()
    os.close(inheritance.lock_fd)  # our share of its lock: the lock is free only once it has exited
    deadline = time.monotonic() + COMMIT_TIMEOUT_S
    while time.monotonic() < deadline:
        with contextlib.suppress(security.DaemonAlreadyRunning):
            daemon.lock.acquire()
            daemon.metrics.handoffs.labels(SUCCESSOR, UNCONFIRMED).inc()
            log.warning("the predecessor did not confirm the hand-off (%s) but has exited; serving", why)
            return
        time.sleep(RETRY_S)
    os.close(inheritance.listener_fd)
    raise security.DaemonAlreadyRunning(
        f"the running daemon did not commit the hand-off ({why}) and still runs"
    )
