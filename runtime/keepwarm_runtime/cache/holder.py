"""The descriptor holder (`keepwarm cache hold`): a daemon that crashes comes back warm.

Like systemd's file-descriptor store, a small process beside the daemons (a second container of the
agent pod) keeps a duplicate of every arena's descriptor with its record (handoff.ArenaRecord), per
daemon socket. A sealed memfd lives as long as any descriptor or mapping of it, so the weights
survive the daemon; a daemon that starts with no predecessor to hand off from reclaims them, verifies
each (adopt.py) and loads only the rest. It never reads, writes or maps an arena.

Commands on ``<socket dir>/keepwarm-holder`` (protocol.py framing; only the holder's own uid, which
must be the daemons' uid, is served; the socket is 0600)::

    {"cmd": "store", "socket": NAME} + a stream   replace NAME's arenas -> {"ok": true, "stored": N}
    {"cmd": "reclaim", "socket": NAME}            -> a stream of NAME's arenas (the holder keeps them)
    {"cmd": "count", "socket": NAME}              -> {"ok": true, "count": N}: how many it keeps
    {"cmd": "handoff", "formats": [1]}            a new holder takes everything, the listener and the
                                                  lock (as daemons do, succession.py); then "commit"

A daemon stores its whole set after every change (load, eviction, release), so what the holder keeps
is never more than what the daemon serves and nothing it dropped stays pinned in memory; it asks for
the ``count`` now and then, to know the holder is there and to store again into a holder that came
back empty (holder_link.py, the daemon's side). Requests are served one at a time with a deadline
each: they are few and small. The functions at the end are the client side of these commands.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from keepwarm_runtime.cache import protocol, security
from keepwarm_runtime.cache.handoff import RECORD_FORMAT, HandoffRefused, Stream, recv_stream, send_stream
from keepwarm_runtime.cache.launcher import READY_PREFIX

log = logging.getLogger(__name__)
HOLDER_NAME = "keepwarm-holder"  # the holder's socket in the socket directory (no .sock: not a cache)
HOLDER_FORMAT = 1  # the holder-to-holder stream: {"socket", "format", "record"} per descriptor
REQUEST_TIMEOUT_S = 10.0
MAX_SOCKET_NAME = 200


def holder_path(socket_dir: Path) -> Path:
    return Path(socket_dir) / HOLDER_NAME


@dataclass
class _Deposit:
    format: int  # the record format the daemon wrote
    items: list[tuple[dict[str, Any], int]] = field(default_factory=list)  # (record, fd)

    def close(self) -> None:
        for _, fd in self.items:
            with contextlib.suppress(OSError):
                os.close(fd)
        self.items = []


class Holder:
    def __init__(self, socket_dir: Path, group: str | None = None) -> None:
        self.socket_dir = Path(socket_dir)
        self.path = holder_path(self.socket_dir)
        self.lock = security.DaemonLock(self.path)
        self._gid = security.resolve_gid(group)
        self.deposits: dict[str, _Deposit] = {}  # daemon socket name -> its arenas
        self._listener: socket.socket | None = None
        self._stop = threading.Event()
        self.handed_off = False

    # -- start ----------------------------------------------------------------------------------

    def start(self) -> None:
        """Take the lock and bind, or take both (and every deposit) from a running holder."""
        security.prepare_socket_dir(self.socket_dir, self._gid)
        while True:
            try:
                self.lock.acquire()
                break
            except security.DaemonAlreadyRunning as busy:
                if self.path.exists() and self._take_over(busy):
                    return
                time.sleep(0.2)
        listener = security.bind_private(self.path, self.lock)
        os.chmod(self.path, 0o600)
        listener.listen(64)
        self._listener = listener

    def _take_over(self, busy: Exception) -> bool:
        try:
            with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
                sock.settimeout(REQUEST_TIMEOUT_S)
                sock.connect(str(self.path))
                if security.peer_cred(sock).uid != os.geteuid():
                    raise security.DaemonAlreadyRunning(f"{busy}; it runs as another uid")
                protocol.send_frame(sock, {"cmd": "handoff", "formats": [HOLDER_FORMAT]})
                stream = recv_stream(sock)
                try:
                    if len(stream.final_fds) != 2 or stream.head.get("format") != HOLDER_FORMAT:
                        fmt = stream.head.get("format")
                        raise HandoffRefused(f"holder stream format {fmt} is not {HOLDER_FORMAT}")
                    protocol.send_frame(sock, {"cmd": "commit"})
                    reply, _ = protocol.recv_frame(sock)
                    if reply.get("committed") is not True:
                        raise HandoffRefused(f"the running holder answered {str(reply)[:200]}")
                    self._listener = socket.socket(fileno=stream.final_fds[0])
                    self.lock.adopt(stream.final_fds[1])
                    stream.final_fds = []
                    for i, (item, fd) in enumerate(stream.items):
                        name, fmt, record = item.get("socket"), item.get("format"), item.get("record")
                        if isinstance(name, str) and type(fmt) is int and isinstance(record, dict):
                            self.deposits.setdefault(name, _Deposit(fmt)).items.append((record, fd))
                            stream.items[i] = (item, -1)
                finally:
                    stream.close()
        except (OSError, protocol.ProtocolError, HandoffRefused) as exc:
            log.info("cannot take over from the running holder yet (%s); retrying", exc)
            return False
        log.info("took %d descriptors over from the running holder", self.count())
        return True

    def count(self) -> int:
        return sum(len(d.items) for d in self.deposits.values())

    # -- serve ----------------------------------------------------------------------------------

    def serve_forever(self) -> None:
        assert self._listener is not None
        self._listener.settimeout(0.2)
        ready = f"{READY_PREFIX}keepwarm holder socket={self.path} pid={os.getpid()}"
        print(ready, file=sys.stderr, flush=True)
        try:
            while not self._stop.is_set():
                try:
                    conn, _ = self._listener.accept()
                except TimeoutError:
                    continue
                with conn:
                    self._serve(conn)
        finally:
            self.close()

    def stop(self) -> None:
        self._stop.set()

    def close(self) -> None:
        if self._listener is not None:
            self._listener.close()
            self._listener = None
            if self.lock.held and not self.handed_off:
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(self.path)
        self.lock.release()
        for deposit in self.deposits.values():
            deposit.close()
        self.deposits = {}

    def _serve(self, conn: socket.socket) -> None:
        conn.settimeout(REQUEST_TIMEOUT_S)
        try:
            cred = security.peer_cred(conn)
            if cred.uid != os.geteuid():
                why = f"the holder serves only its own uid {os.geteuid()}; uid {cred.uid} is refused"
                log.warning("refused pid=%d: %s", cred.pid, why)
                protocol.send_frame(conn, protocol.error_reply("forbidden", why))
                return
            request, fds = protocol.recv_frame(
                conn, protocol.MAX_REQUEST_BYTES, frame_timeout_s=REQUEST_TIMEOUT_S
            )
            for fd in fds:
                os.close(fd)
            cmd = request.get("cmd")
            if cmd == "handoff":
                self._give(conn, request)
                return
            name = request.get("socket")
            if not isinstance(name, str) or not name or len(name) > MAX_SOCKET_NAME or "/" in name:
                why = "'socket' must be a daemon socket's file name"
                protocol.send_frame(conn, protocol.error_reply("bad_request", why))
            elif cmd == "store":
                self._store(conn, name)
            elif cmd == "reclaim":
                deposit = self.deposits.get(name) or _Deposit(RECORD_FORMAT)
                send_stream(conn, {"format": deposit.format}, deposit.items)
            elif cmd == "count":
                count = len(self.deposits[name].items) if name in self.deposits else 0
                protocol.send_frame(conn, {"ok": True, "count": count})
            else:
                why = f"unknown command {str(cmd)[:64]!r}"
                protocol.send_frame(conn, protocol.error_reply("unknown_command", why))
        except (OSError, protocol.ProtocolError, HandoffRefused) as exc:
            log.warning("holder request failed: %s", exc)

    def _store(self, conn: socket.socket, name: str) -> None:
        stream = recv_stream(conn)
        fmt = stream.head.get("format")
        if type(fmt) is not int:
            stream.close()
            why = "store: the stream names no format"
            protocol.send_frame(conn, protocol.error_reply("bad_request", why))
            return
        old = self.deposits.pop(name, None)
        self.deposits[name] = _Deposit(fmt, list(stream.items))
        stream.items = []  # the deposit owns the descriptors now
        if old is not None:
            old.close()
        protocol.send_frame(conn, {"ok": True, "stored": len(self.deposits[name].items)})

    def _give(self, conn: socket.socket, request: dict[str, Any]) -> None:
        formats = request.get("formats")
        if not isinstance(formats, list) or HOLDER_FORMAT not in formats:
            why = f"this holder writes format {HOLDER_FORMAT}; the new holder reads {str(formats)[:100]}"
            protocol.send_frame(conn, protocol.error_reply("handoff_format", why))
            return
        assert self._listener is not None and self.lock.fd is not None
        items = [
            ({"socket": name, "format": d.format, "record": record}, fd)
            for name, d in self.deposits.items()
            for record, fd in d.items
        ]
        final = [self._listener.fileno(), self.lock.fd]
        send_stream(conn, {"format": HOLDER_FORMAT, "pid": os.getpid()}, items, final)
        conn.settimeout(REQUEST_TIMEOUT_S * 3)
        request, fds = protocol.recv_frame(conn, protocol.MAX_REQUEST_BYTES)
        for fd in fds:
            os.close(fd)
        if request.get("cmd") != "commit":
            log.warning("holder hand-off abandoned; still holding")
            return
        self.handed_off = True
        self._stop.set()
        protocol.send_frame(conn, {"ok": True, "committed": True})
        log.info("handed %d descriptors to the new holder; exiting", len(items))


# -- the client side (a daemon's: holder_link.py) ----------------------------------------------


def _connect(socket_dir: Path) -> socket.socket | None:
    """A connection to the holder, or None when there is none or it does not accept (no holder is
    not an error); a holder of another uid raises CacheSecurityError (never used)."""
    path = holder_path(socket_dir)
    if not path.exists():
        return None
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.settimeout(REQUEST_TIMEOUT_S)
    try:
        sock.connect(str(path))
        uid = security.peer_cred(sock).uid
    except OSError:
        sock.close()
        return None
    if uid != os.geteuid():
        sock.close()
        raise security.CacheSecurityError(f"the holder at {path} runs as uid {uid}, not {os.geteuid()}")
    return sock


def reclaim(socket_dir: Path, socket_name: str) -> Stream | None:
    """The holder's arenas for ``socket_name`` (the caller owns and closes the stream), or None."""
    sock = _connect(socket_dir)
    if sock is None:
        return None
    with sock:
        protocol.send_frame(sock, {"cmd": "reclaim", "socket": socket_name})
        return recv_stream(sock)


def store(socket_dir: Path, socket_name: str, items: list[tuple[dict[str, Any], int]]) -> int | None:
    """Replace the holder's arenas for ``socket_name`` with ``items`` (fds are sent, not closed);
    None when there is no holder."""
    sock = _connect(socket_dir)
    if sock is None:
        return None
    with sock:
        protocol.send_frame(sock, {"cmd": "store", "socket": socket_name})
        send_stream(sock, {"format": RECORD_FORMAT}, items)
        reply, fds = protocol.recv_frame(sock)
    for fd in fds:
        os.close(fd)
    if not reply.get("ok"):
        raise HandoffRefused(f"the holder refused: {reply.get('error')}")
    return int(reply["stored"])


def count(socket_dir: Path, socket_name: str) -> int | None:
    """How many arenas the holder keeps for ``socket_name``; None when there is no holder, -1 when it
    answers but does not know the command (a holder from before ``count``)."""
    sock = _connect(socket_dir)
    if sock is None:
        return None
    with sock:
        protocol.send_frame(sock, {"cmd": "count", "socket": socket_name})
        reply, fds = protocol.recv_frame(sock)
    for fd in fds:
        os.close(fd)
    if reply.get("ok") is True and type(reply.get("count")) is int:
        return reply["count"]
    if (reply.get("error") or {}).get("code") == "unknown_command":
        return -1
    raise HandoffRefused(f"the holder answered count with {str(reply)[:200]}")
