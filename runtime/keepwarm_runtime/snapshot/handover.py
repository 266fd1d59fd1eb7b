"""A restore hands the API socket its launcher bound (server/listener.py) to the restored parent.

The launcher listens on a unix socket at a fresh abstract address, in the pod's network namespace
(only the pod's own processes can reach it); the address travels in the restore's Context (wire.py).
The restored parent connects and receives the listening socket by SCM_RIGHTS; the launcher answers
only the restored parent's pid (SO_PEERCRED), then keeps no copy, so the socket closes when the
parent closes it. Anything short of that leaves the parent to bind its own, as before.
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


def receive(address: str, timeout: float = 10.0) -> socket.socket | None:
    """In a restored parent: the launcher's listening socket, taken from ``address``; None when none
    came (the parent then binds its own)."""
    try:
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as conn:
            conn.settimeout(timeout)
            conn.connect("\0" + address)
            _, fds, _, _ = socket.recv_fds(conn, 1, 1)
    except OSError as exc:
        log.warning("no API socket from the launcher (%s); binding it here", exc)
        return None
    if len(fds) != 1:
        for fd in fds:
            os.close(fd)
        return None
    sock = socket.socket(fileno=fds[0])
    with contextlib.suppress(OSError):
        if sock.type == socket.SOCK_STREAM and sock.getsockopt(socket.SOL_SOCKET, socket.SO_ACCEPTCONN):
            return sock
    sock.close()
    return None
