"""The daemon's socket server: accept loop, per-peer checks and limits, one thread per connection.

Each request goes to the command handlers (handlers.py), except ``handoff``, whose connection becomes
the hand-off's (succession.py); both act on the daemon core (core.py).

What a hostile or unlucky local client cannot do here:

* exhaust the daemon's descriptors or lock others out: the soft RLIMIT_NOFILE is raised to the hard
  limit at start, connections are capped overall (by default under the descriptor limit) and per
  uid, at a cap the longest-idle connection gives way to a newcomer (``limits.py``) and only
  without one is the newcomer answered ``busy``, and EMFILE/ENFILE on ``accept`` backs off and
  keeps serving;
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
import socket
import threading
import time
from typing import TYPE_CHECKING

from keepwarm_runtime.cache import protocol, security, succession
from keepwarm_runtime.cache.handlers import BadRequest, CommandHandlers
from keepwarm_runtime.cache.limits import ConnectionTable, ServerLimits, connection_cap

if TYPE_CHECKING:
    from keepwarm_runtime.cache.core import DaemonCore

log = logging.getLogger(__name__)
_ACCEPT_ERRNOS = {errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
_SEND_TIMEOUT_S = 1.0  # a refusal is one small frame into an empty socket buffer


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
    def __init__(
        self,
        daemon: DaemonCore,
        handlers: CommandHandlers,
        listener: socket.socket,
        limits: ServerLimits,
        nofile: int,
    ) -> None:
        self.daemon, self.handlers, self.listener, self.limits = daemon, handlers, listener, limits
        self.table = ConnectionTable(
            connection_cap(limits.max_connections, nofile), limits.max_connections_per_uid
        )
        self.client_log = RateLimitedLog()

    def serve(self, stop: threading.Event) -> None:
        try:
            self._accept_until(stop)
        finally:
            if self.daemon.handed_off:
                self.drain(self.limits.request_deadline_s * 3)

    def drain(self, timeout_s: float) -> None:
        """After a hand-off: let open connections finish their requests (their clients are served by
        this daemon, never refused), then close whatever is still open."""
        deadline = time.monotonic() + timeout_s
        while self.table.total() and time.monotonic() < deadline:
            time.sleep(0.01)
        left = self.table.close_all()
        log.info("drained; %d idle connections closed", left)

    def _accept_until(self, stop: threading.Event) -> None:
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
        conn_id, why = self.table.admit(cred.uid, conn)
        if conn_id is None:
            self.daemon.metrics.refused_connections.labels("busy").inc()
            self.client_log.warning("refused pid=%d uid=%d: %s", cred.pid, cred.uid, why)
            self._refuse(conn, "busy", why)
            return
        try:
            threading.Thread(target=self._serve_counted, args=(conn, cred, conn_id), daemon=True).start()
        except RuntimeError as exc:  # "can't start new thread"
            self.table.release(conn_id)
            self._refuse(conn, "busy", f"the daemon cannot start a thread: {exc}")

    @staticmethod
    def _refuse(conn: socket.socket, code: str, message: str) -> None:
        with conn:
            conn.settimeout(_SEND_TIMEOUT_S)
            with contextlib.suppress(OSError):
                protocol.send_frame(conn, protocol.error_reply(code, message))

    def _serve_counted(self, conn: socket.socket, cred: security.PeerCred, conn_id: int) -> None:
        try:
            with conn:
                self._serve(conn, cred, conn_id)
        except Exception as exc:  # the last line of defence: one line, never a traceback
            self.client_log.warning("connection of pid=%d ended by %s: %s", cred.pid, type(exc).__name__, exc)
        finally:
            self.table.release(conn_id)

    def _serve(self, conn: socket.socket, cred: security.PeerCred, conn_id: int) -> None:
        d, limits = self.daemon, self.limits
        if not d.policy.allows(cred):
            why = d.policy.refusal(cred)
            d.metrics.refused_peers.inc()
            d.refusals.record(why)
            self.client_log.warning("refused peer pid=%d: %s", cred.pid, why)
            self._refuse(conn, "forbidden", why)
            return
        # After a hand-off, a connection this daemon accepted is still served until its client closes.
        while (d.handed_off or not d.stopping) and self.table.waiting(conn_id, idle=True):
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
            if not self.table.waiting(conn_id, idle=False):
                return  # reclaimed for a newcomer just as this request arrived
            if request.get("cmd") == "handoff":  # the connection becomes the hand-off's (succession.py)
                succession.give(d, conn, cred, request)
                return
            try:
                reply, out_fds = self.handlers.dispatch(request)
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
