"""One non-blocking ``GET /health`` to the serving worker, driven by the supervisor's select loop.

The supervising parent is one thread: a blocking request to a worker that has just died (the
connection waits in the listen backlog) or is still loading would stall it, and with it the reaping
of a dead worker and the parent's own /health (the liveness probe's). So the probe is a small state
machine over a non-blocking socket: connect, send, read to EOF, read the engine state out of the JSON
body. The supervisor judges silence by time since the last answer; a probe never answered simply
stays in flight until the worker is replaced.
"""

from __future__ import annotations

import contextlib
import json
import selectors
import socket
import time

PENDING = "pending"  # ``on_event``: not finished yet
REQUEST = b"GET /health HTTP/1.1\r\nHost: keepwarm-supervisor\r\nConnection: close\r\n\r\n"
MAX_ANSWER = 64 * 1024


def engine_state(answer: bytes) -> str | None:
    """The ``engine`` field of a /health answer (head and JSON body), None if it is not one."""
    _, sep, body = answer.partition(b"\r\n\r\n")
    if not sep:
        return None
    try:
        state = json.loads(body).get("engine")
    except (ValueError, AttributeError):
        return None
    return str(state) if state is not None else None


class HealthProbe:
    """``start()`` registers a socket with ``selector`` (data: this probe); feed its events to
    ``on_event``, which returns PENDING, the engine state, or None when the exchange failed."""

    def __init__(self, address: tuple[str, int], selector: selectors.BaseSelector) -> None:
        self.address, self.selector = address, selector
        self.started_at = time.monotonic()
        self._sock: socket.socket | None = None
        self._sent = 0
        self._answer = b""

    def start(self) -> None:
        family = socket.AF_INET6 if ":" in self.address[0] else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setblocking(False)
        self._sock.connect_ex(self.address)
        self.selector.register(self._sock, selectors.EVENT_WRITE, self)

    def on_event(self, mask: int) -> str | None:
        sock = self._sock
        assert sock is not None, "on_event before start"
        try:
            if mask & selectors.EVENT_WRITE:
                self._sent += sock.send(REQUEST[self._sent :])
                if self._sent == len(REQUEST):
                    self.selector.modify(sock, selectors.EVENT_READ, self)
                return PENDING
            chunk = sock.recv(16384)
        except (BlockingIOError, InterruptedError):
            return PENDING
        except OSError:
            self.close()
            return None
        self._answer += chunk
        if chunk and len(self._answer) < MAX_ANSWER:
            return PENDING
        self.close()
        return engine_state(self._answer)

    def close(self) -> None:
        if self._sock is None:
            return
        with contextlib.suppress(KeyError, ValueError):
            self.selector.unregister(self._sock)
        self._sock.close()
        self._sock = None
