"""The API's listening socket, bound the moment `keepwarm serve` starts and kept by whoever serves.

The kubelet probes a new pod's /ready (a long poll: operator/builders/runtime.py) once a second from
when it admits the pod; an attempt before anything listens is refused, and the next comes a second
later. A parent restored from a snapshot bound its port about 0.5 s after the container started,
just after one of those ticks: on the real node the pod's Ready came 1.0-1.3 s after its worker was
ready (docs/benchmarks/pod-restart.md). Bound first thing, the socket queues the probe's connection
until a worker answers it. An importing start keeps it in the same process (``take``); a restore
hands it to the restored parent (``offer`` in the launcher, ``receive`` in the parent: SCM_RIGHTS
over a unix socket in the pod's network namespace, whose abstract address travels in the restore's
Context, the peer's pid checked), and the launcher keeps no copy. Where the early bind fails, the
supervising parent binds later as before and reports the error there.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
import select
import socket
import struct
import time

log = logging.getLogger(__name__)

_early: socket.socket | None = None  # bound by bind_early or received from the launcher, until taken


def bind_early(host: str, port: int) -> None:
    """Bind and listen on host:port now, unless this process already holds such a socket."""
    global _early
    if _early is not None:
        return
    from keepwarm_runtime.server.supervisor import bind_listener

    try:
        _early = bind_listener(host, port)
    except OSError as exc:  # the supervising parent's own bind names it, at the usual place
        log.info("the API port is bound later: %s:%d: %s", host, port, exc)


def held() -> socket.socket | None:
    """The early socket this process holds (None: none)."""
    return _early


def take(port: int) -> socket.socket | None:
    """The early socket, now the caller's, if it listens on ``port``; else None (another is closed:
    the caller binds what its settings say)."""
    global _early
    sock, _early = _early, None
    if sock is None:
        return None
    with contextlib.suppress(OSError):
        if sock.getsockname()[1] == port:
            return sock
    sock.close()
    return None


def give_up() -> None:
    """Close the early socket this process holds (it handed it over, or will not serve)."""
    global _early
    sock, _early = _early, None
    if sock is not None:
        sock.close()


class Offer:
    """The launcher's side of a hand-over: a unix socket at a fresh abstract address."""

    def __init__(self) -> None:
        self.address = f"keepwarm-listener-{secrets.token_hex(8)}"
        self._server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self._server.bind("\0" + self.address)
        self._server.listen(1)

    def hand_over(self, sock: socket.socket, pid: int, timeout: float, stop_fd: int | None = None) -> bool:
        """Send ``sock`` to the first connection from process ``pid`` within ``timeout`` seconds; True
        when it went. Connections from any other process are closed unanswered; ``stop_fd`` readable
        (the restored parent answered or died without asking) ends the wait."""
        deadline = time.monotonic() + timeout
        watched = [self._server] + ([stop_fd] if stop_fd is not None else [])
        try:
            while (remaining := deadline - time.monotonic()) > 0:
                ready = select.select(watched, [], [], remaining)[0]
                if self._server not in ready:
                    return False
                conn, _ = self._server.accept()
                with conn:
                    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
                    if struct.unpack("3i", creds)[0] != pid:
                        continue
                    socket.send_fds(conn, [b"L"], [sock.fileno()])
                    return True
            return False
        except OSError as exc:
            log.warning("the API socket was not handed over (%s); the restored parent binds it", exc)
            return False
        finally:
            self._server.close()

    def close(self) -> None:
        self._server.close()


def receive(address: str, timeout: float = 10.0) -> bool:
    """In a restored parent: take the launcher's listening socket from ``address``; True when it came
    (``take`` then returns it)."""
    global _early
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect("\0" + address)
            _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    except OSError as exc:
        log.warning("no API socket from the launcher (%s); binding it here", exc)
        return False
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return False
    sock = socket.socket(fileno=fds[0])
    with contextlib.suppress(OSError):
        if sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            _early = sock
            return True
    sock.close()
    return False
