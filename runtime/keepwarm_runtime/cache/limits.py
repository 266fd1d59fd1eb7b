"""How many client connections the daemon holds, and which idle one gives way to a new one.

Clients attach in milliseconds (connect, ``hello``, ``get_state``, close), so a connection that
waits between frames is either slow to finish or hostile. When a limit is reached (overall, or for
one uid), the connection that has waited longest for its next request, beyond ``RECLAIM_AFTER_S``,
is shut down to make room; only when none is idle is the newcomer refused (``busy``). A client
that opens hundreds of idle connections thus cannot lock others, not even of its own uid, out.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import resource
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

log = logging.getLogger(__name__)
FD_RESERVE = 64  # descriptors kept free for arenas, loads, logs and the metrics server
DEFAULT_MAX_CONNECTIONS = 256
RECLAIM_AFTER_S = 0.5  # an idle connection younger than this is never shut down for a newcomer


@dataclass(frozen=True)
class ServerLimits:
    max_connections: int | None = None  # in all; None: DEFAULT_MAX_CONNECTIONS under the fd limit
    max_connections_per_uid: int = 32  # open client connections of one uid
    request_deadline_s: float = 10.0  # one whole request frame, from its first byte
    idle_timeout_s: float = 300.0  # silence between frames before the daemon closes


def raise_nofile_limit() -> int:
    """Raise the soft open-files limit to the hard limit; return the soft limit now in force."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY:  # the kernel still caps descriptors at fs.nr_open
        try:
            hard = int(Path("/proc/sys/fs/nr_open").read_text())
        except (OSError, ValueError):
            hard = max(soft, 1 << 20)
    if soft != hard:
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


@dataclass
class _Entry:
    uid: int
    sock: socket.socket
    idle_since: float | None  # monotonic time it started waiting for a request; None while busy


class ConnectionTable:
    """Open connections by id; ``admit`` is check-reclaim-and-count under one lock."""

    def __init__(self, max_total: int, max_per_uid: int) -> None:
        self.max_total, self.max_per_uid = max_total, max_per_uid
        self._entries: dict[int, _Entry] = {}
        self._ids = itertools.count()
        self._lock = threading.Lock()

    def admit(self, uid: int, sock: socket.socket) -> tuple[int | None, str | None]:
        """(id, None) for an admitted connection, or (None, why it is refused)."""
        with self._lock:
            mine = [e for e in self._entries.values() if e.uid == uid]
            if len(mine) >= self.max_per_uid and not self._reclaim(mine):
                return None, f"uid {uid} has {self.max_per_uid} busy connections (the per-uid maximum)"
            if len(self._entries) >= self.max_total and not self._reclaim(list(self._entries.values())):
                return None, f"the daemon has {self.max_total} busy connections (its maximum); retry later"
            conn_id = next(self._ids)
            self._entries[conn_id] = _Entry(uid, sock, None)
            return conn_id, None

    def _reclaim(self, candidates: list[_Entry]) -> bool:
        """Shut down the longest-idle candidate (lock held); False when none is idle long enough."""
        cutoff = time.monotonic() - RECLAIM_AFTER_S
        idle = [e for e in candidates if e.idle_since is not None and e.idle_since <= cutoff]
        if not idle:
            return False
        victim = min(idle, key=lambda e: e.idle_since)  # type: ignore[arg-type, return-value]
        for conn_id, entry in list(self._entries.items()):
            if entry is victim:
                del self._entries[conn_id]
        with contextlib.suppress(OSError):
            victim.sock.shutdown(socket.SHUT_RDWR)  # its thread sees EOF, closes and leaves
        return True

    def waiting(self, conn_id: int, idle: bool) -> bool:
        """Mark a connection as waiting for a request (or not); False once it has been reclaimed."""
        with self._lock:
            entry = self._entries.get(conn_id)
            if entry is not None:
                entry.idle_since = time.monotonic() if idle else None
            return entry is not None

    def release(self, conn_id: int) -> None:
        with self._lock:
            self._entries.pop(conn_id, None)

    def close_all(self) -> int:
        """Shut down every open connection (their threads see EOF and leave); returns how many."""
        with self._lock:
            entries, self._entries = list(self._entries.values()), {}
        for entry in entries:
            with contextlib.suppress(OSError):
                entry.sock.shutdown(socket.SHUT_RDWR)
        return len(entries)

    def total(self) -> int:
        with self._lock:
            return len(self._entries)
