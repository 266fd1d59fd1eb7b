"""The daemon's socket server: accept loop, per-peer checks and limits, one thread per connection.

What a hostile or unlucky local client cannot do here:

* exhaust the daemon's descriptors: the soft RLIMIT_NOFILE is raised to the hard limit at start,
  connections are capped overall (and under the descriptor limit) and per uid, a refused one gets a
  ``busy`` error frame, and EMFILE/ENFILE on ``accept`` backs off and keeps serving;
* hold a thread by dripping bytes: a whole request frame has a deadline from its first byte, and a
  connection idle between frames is closed;
* crash the daemon or flood its log with malformed frames: every bad frame is an error reply and a
  close, logged as one rate-limited line, never a traceback.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import resource
import socket
import threading
import time
from collections import Counter
from dataclasses import dataclass
from typing import TYPE_CHECKING

from keepwarm_runtime.cache import protocol, security
from keepwarm_runtime.cache.handlers import BadRequest

if TYPE_CHECKING:
    from keepwarm_runtime.cache.daemon import CacheDaemon

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors kept free for arenas, loads, logs and the metrics server
DEFAULT_MAX_CONNECTIONS = 256
_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_SEND_TIMEOUT_S = 1.0  # a refusal is one small frame into an empty socket buffer


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int | None = None  # open client connections in all; None: DEFAULT_MAX_CONNECTIONS
    # bounded by the open-files limit (an explicit number is taken as given)
    max_connections_per_uid: int = 32  # open client connections of one uid
    request_deadline_s: float = 10.0  # one whole request frame, from its first byte
    idle_timeout_s: float = 300.0  # silence between frames before the daemon closes


def raise_nofile_limit() -> int:
    """Raise the soft open-files limit to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:
            log.warning("could not raise the open-files limit from %d to %d: %s", soft, hard, exc)
    return soft


def connection_cap(configured: int | None, nofile: int) -> int:
    """Connections the daemon admits: as configured, or by default as many as fit (each with the
    one fd a hit dups) under the open-files limit beside the reserve."""
    if configured is not None:
        return configured
    return max(1, min(DEFAULT_MAX_CONNECTIONS, (nofile - FD_RESERVE) // 2))


class ConnectionCounts:
    """Open connections overall and per uid; ``admit`` is check-and-count under one lock."""

    def __init__(self, max_total: int, max_per_uid: int) -> None:
        self.max_total, self.max_per_uid = max_total, max_per_uid
        self._per_uid: Counter[int] = Counter()
        self._lock = threading.Lock()

    def admit(self, uid: int) -> str | None:
        """Count a new connection of ``uid``, or say why it is refused."""
        with self._lock:
            if sum(self._per_uid.values()) >= self.max_total:
                return f"the daemon has {self.max_total} connections open (its maximum); retry later"
            if self._per_uid[uid] >= self.max_per_uid:
                return f"uid {uid} has {self.max_per_uid} connections open (the per-uid maximum)"
            self._per_uid[uid] += 1
            return None

    def release(self, uid: int) -> None:
        with self._lock:
            self._per_uid[uid] -= 1
            if self._per_uid[uid] <= 0:
                del self._per_uid[uid]

    def total(self) -> int:
        with self._lock:
            return sum(self._per_uid.values())


class RateLimitedLog:
    """At most ``burst`` lines per ``window_s``; the next line that passes says how many were dropped."""

    def __init__(self, burst: int = 10, window_s: float = 10.0) -> None:
        self.burst, self.window_s = burst, window_s
        self._start, self._count, self._dropped = 0.0, 0, 0
        self._lock = threading.Lock()

    def warning(self, fmt: str, *args: object) -> None:
        with self._lock:
            now = time.monotonic()
            if now - self._start >= self.window_s:
                self._start, self._count = now, 0
            if self._count >= self.burst:
                self._dropped += 1
                return
            self._count += 1
            dropped, self._dropped = self._dropped, 0
        suffix = f" ({dropped} similar lines suppressed)" if dropped else ""
        log.warning(fmt + suffix, *args)


class SocketServer:
    def __init__(self, daemon: CacheDaemon, listener: socket.socket, limits: ServerLimits, nofile: int):
        self.daemon, self.listener, self.limits = daemon, listener, limits
        self.counts = ConnectionCounts(
            connection_cap(limits.max_connections, nofile), limits.max_connections_per_uid
        )
        self.client_log = RateLimitedLog()

    def serve(self, stop: threading.Event) -> None:
        backoff = 0.0
        while not stop.is_set():
            try:
                conn, _ = self.listener.accept()
            except TimeoutError:
                continue
            except OSError as exc:
                if exc.errno not in _ACCEPT_ERRNOS:
                    raise
                backoff = min(1.0, backoff * 2 or 0.01)
                self.daemon.metrics.accept_errors.labels(errno.errorcode.get(exc.errno, "?")).inc()
                self.client_log.warning("accept failed (%s); backing off %.2fs", exc.strerror, backoff)
                stop.wait(backoff)
                continue
            backoff = 0.0
            self._admit(conn)

    def _admit(self, conn: socket.socket) -> None:
        try:
            cred = security.peer_cred(conn, with_groups=True)
        except OSError as exc:
            conn.close()
            self.client_log.warning("dropped a connection whose credentials are unreadable: %s", exc)
            return
        why = self.counts.admit(cred.uid)
        if why is not None:
            self.daemon.metrics.refused_connections.labels("busy").inc()
            self.client_log.warning("refused pid=%d uid=%d: %s", cred.pid, cred.uid, why)
            self._refuse(conn, "busy", why)
            return
        try:
            threading.Thread(target=self._serve_counted, args=(conn, cred), daemon=True).start()
        except RuntimeError as exc:  # "can't start new thread"
            self.counts.release(cred.uid)
            self._refuse(conn, "busy", f"the daemon cannot start a thread: {exc}")

    @staticmethod
    def _refuse(conn: socket.socket, code: str, message: str) -> None:
        with conn:
            conn.settimeout(_SEND_TIMEOUT_S)
            with contextlib.suppress(OSError):
                protocol.send_frame(conn, protocol.error_reply(code, message))

    def _serve_counted(self, conn: socket.socket, cred: security.PeerCred) -> None:
        try:
            with conn:
                self._serve(conn, cred)
        except Exception as exc:  # the last line of defence: one line, never a traceback
            self.client_log.warning("connection of pid=%d ended by %s: %s", cred.pid, type(exc).__name__, exc)
        finally:
            self.counts.release(cred.uid)

    def _serve(self, conn: socket.socket, cred: security.PeerCred) -> None:
        d, limits = self.daemon, self.limits
        if not d.policy.allows(cred):
            d.metrics.refused_peers.inc()
            self.client_log.warning("refused peer pid=%d: %s", cred.pid, d.policy.refusal(cred))
            self._refuse(conn, "forbidden", d.policy.refusal(cred))
            return
        while not d.stopping:
            try:
                request, fds = protocol.recv_frame(
                    conn,
                    protocol.MAX_REQUEST_BYTES,
                    idle_timeout_s=limits.idle_timeout_s,
                    frame_timeout_s=limits.request_deadline_s,
                )
            except protocol.PeerClosed:
                return
            except protocol.ProtocolError as exc:
                self._bad_frame(conn, cred, exc)
                return
            for fd in fds:  # clients have no business sending fds
                os.close(fd)
            try:
                reply, out_fds = d.handlers.dispatch(request)
            except BadRequest as exc:
                self._bad_frame(conn, cred, exc)
                return
            try:
                conn.settimeout(limits.request_deadline_s)  # a client that never reads cannot hold us
                protocol.send_frame(conn, reply, out_fds)
            except OSError as exc:
                log.debug("reply to pid=%d failed: %s", cred.pid, exc)
                return
            finally:
                for fd in out_fds:
                    os.close(fd)

    def _bad_frame(self, conn: socket.socket, cred: security.PeerCred, exc: protocol.ProtocolError) -> None:
        self.daemon.metrics.bad_frames.labels(exc.code).inc()
        if exc.code != "idle":
            self.client_log.warning("bad frame from pid=%d uid=%d: %s: %s", cred.pid, cred.uid, exc.code, exc)
        try:
            conn.settimeout(_SEND_TIMEOUT_S)
            protocol.send_frame(conn, protocol.error_reply(exc.code, str(exc)))
        except OSError:
            pass
