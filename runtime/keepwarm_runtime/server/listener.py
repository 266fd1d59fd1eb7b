"""The API's listening socket, bound the moment `keepwarm serve` starts and kept by whoever serves.

The kubelet probes a new pod's /ready (a long poll: operator/builders/runtime.py) once a second from
when it admits the pod; an attempt before anything listens is refused, and the next comes a second
later. A parent restored from a snapshot bound its port about 0.5 s after the container started,
just after one of those ticks: on the real node the pod's Ready came 1.0-1.3 s after its worker was
ready (docs/benchmarks/pod-restart.md). Bound first thing, the socket queues the probe's connection
until a worker answers it. An importing start keeps it in the same process (``take``); a restore
hands it to the restored parent (snapshot/handover.py), which holds it here (``adopt``), and the
launcher keeps no copy. Where the early bind fails, the supervising parent binds later as before and
reports the error there.
"""

from __future__ import annotations

import contextlib
import logging
import socket

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


def adopt(sock: socket.socket) -> None:
    """Hold ``sock`` as the early socket (a restored parent's, handed over by its launcher)."""
    global _early
    give_up()
    _early = sock
