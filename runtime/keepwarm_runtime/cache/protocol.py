"""Wire protocol between the cache daemon and its clients, over a Unix stream socket.

Framing (both directions)::

    +----------------------+-----------------------------+
    | length: u32 big-end. | header: `length` bytes JSON |
    +----------------------+-----------------------------+

* The header is one UTF-8 JSON object. Requests carry ``"cmd"``; replies carry ``"ok"`` (bool) and,
  when ``ok`` is false, ``"error": {"code": str, "message": str}``.
* File descriptors (memfds of the host tier, CUDA VMM POSIX-fd handles of the gpu tier) travel as
  SCM_RIGHTS ancillary data on the same ``sendmsg`` as the frame's first bytes; the header says how
  many with ``"nfds"``. A frame whose fd count does not match its header is a protocol error.
* ``length`` is at most ``MAX_FRAME_BYTES`` (callers may pass a smaller ``limit``); a longer frame is
  rejected before its body is read. The peer that detects a bad frame replies with an error (when
  it is the daemon) and closes the connection. Anything that fails to decode (bad UTF-8, bad JSON,
  nesting too deep, integers too long, the wrong types) is such a bad frame, never an exception
  that escapes ``recv_frame``.
* A reader may bound a whole frame in time (``frame_timeout_s``, counted from its first byte), so a
  peer dripping one byte at a time cannot hold a connection open; between frames it waits at most
  ``idle_timeout_s``.
* Nothing received is ever unpickled or evaluated: JSON and fds only.

Commands (see ``handlers.py``): ``hello``, ``get_state``, ``list``, ``release``, ``stats``; and
``handoff`` (then ``commit``) for a successor daemon of the same uid (``succession.py``, whose
streams of arena records ``handoff.py`` specifies).

* ``get_state`` answers ``state`` "hit" (with the arena fd, ``tensors``, ``aliases``, ``page_mode``,
  ``gpu_uuid``, ``digest``), "mismatch" (``fields`` that differ, and ``reason`` "changed on disk"
  when the daemon found the resident model's files rewritten) or "absent".
* ``list`` answers ``models``: one row per model with ``state`` "Resident" (``bytes``, ``pinned``,
  ``tier``, ``key_digest``, ``path``, ``kind`` "model" or "adapter": a LoRA adapter, cache/adapters.py)
  or "Failed" (``path``, ``reason`` naming the file).
* ``stats`` answers the daemon's snapshot (``snapshot.py``: what the node agent reads in-process),
  in this order: ``version``, ``pid``, ``tier``, ``socket``, ``dtype``, ``budget``, ``resident_bytes``,
  ``gpu_uuid``, ``serves_gpu``, ``models`` (name -> a resident model or adapter: ``path``, ``bytes``,
  ``fingerprint``, ``key_digest``, ``digest``, ``pinned``, ``tier``, ``gpu_uuids``, ``num_tensors``,
  ``load_seconds``, ``hits``, ``page_mode``, ``state`` "Resident", ``kind``), ``failed``
  (name -> ``{"state": "Failed", "path", "reason"}``) and ``refusals`` (null, or the latest episode of
  refused peers: keepwarm_api.refusals).
"""

from __future__ import annotations

import array
import json
import os
import socket
import struct
import time
from typing import Any

PROTOCOL_VERSION = 1
MAX_FRAME_BYTES = 16 << 20  # replies carry tensor tables: ~150 bytes per tensor
MAX_REQUEST_BYTES = 64 << 10  # the daemon's limit for what clients send
MAX_FDS = 16  # an attach opens one fd per model (one arena / one VMM allocation)

_PREFIX = struct.Struct(">I")


class ProtocolError(Exception):
    """The peer sent something that is not a valid frame; the connection must be closed.

    ``code`` is a stable machine-readable reason (``too_large``, ``truncated``, ``bad_json``,
    ``bad_fds``, ``deadline``, ``idle``) that the daemon puts in its error reply.
    """

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code


class PeerClosed(ProtocolError):
    """The peer closed the connection cleanly between frames."""

    def __init__(self) -> None:
        super().__init__("closed", "peer closed the connection")


def encode(header: dict[str, Any], limit: int = MAX_FRAME_BYTES) -> bytes:
    body = json.dumps(header, separators=(",", ":")).encode()
    if len(body) > limit:
        raise ProtocolError("too_large", f"frame of {len(body)} bytes exceeds the limit of {limit}")
    return _PREFIX.pack(len(body)) + body


def send_frame(sock: socket.socket, header: dict[str, Any], fds: list[int] | tuple[int, ...] = ()) -> None:
    """Send one frame; ``fds`` ride on the first bytes and ``nfds`` is set in the header."""
    if len(fds) > MAX_FDS:
        raise ProtocolError("bad_fds", f"{len(fds)} fds exceed the limit of {MAX_FDS}")
    data = encode({**header, "nfds": len(fds)})
    if fds:
        sent = socket.send_fds(sock, [data], list(fds))
        data = data[sent:]
    if data:
        sock.sendall(data)


class _Clock:
    """Time limits of one frame read: idle until the first byte, then a deadline for the whole frame."""

    def __init__(self, idle_timeout_s: float | None, frame_timeout_s: float | None) -> None:
        self.idle_timeout_s, self.frame_timeout_s = idle_timeout_s, frame_timeout_s
        self.deadline: float | None = None

    def started(self) -> None:
        if self.deadline is None and self.frame_timeout_s is not None:
            self.deadline = time.monotonic() + self.frame_timeout_s

    def arm(self, sock: socket.socket) -> None:
        if self.deadline is not None:
            remaining = self.deadline - time.monotonic()
            if remaining <= 0:
                raise ProtocolError("deadline", f"frame not complete within {self.frame_timeout_s:g}s")
            sock.settimeout(remaining)
        elif self.idle_timeout_s is not None:
            sock.settimeout(self.idle_timeout_s)

    def expired(self) -> ProtocolError:
        if self.deadline is not None:
            return ProtocolError("deadline", f"frame not complete within {self.frame_timeout_s:g}s")
        return ProtocolError("idle", f"no request for {self.idle_timeout_s:g}s")


def _recv_exact(sock: socket.socket, n: int, fds: list[int], clock: _Clock, *, at_start: bool) -> bytes:
    buf = bytearray()
    cmsg_space = socket.CMSG_SPACE(MAX_FDS * array.array("i").itemsize)
    while len(buf) < n:
        clock.arm(sock)
        try:
            data, ancdata, flags, _ = sock.recvmsg(n - len(buf), cmsg_space)
        except TimeoutError:
            if clock.deadline is None and clock.idle_timeout_s is None:
                raise  # the caller's own socket timeout
            raise clock.expired() from None
        for level, kind, payload in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                got = array.array("i")
                got.frombytes(payload[: len(payload) - len(payload) % got.itemsize])
                fds.extend(got)
        if flags & socket.MSG_CTRUNC:
            raise ProtocolError("bad_fds", f"more than {MAX_FDS} file descriptors in one frame")
        if not data:
            if at_start and not buf:
                raise PeerClosed()
            raise ProtocolError("truncated", f"connection closed after {len(buf)} of {n} bytes")
        clock.started()
        buf += data
    return bytes(buf)


def decode_header(body: bytes) -> dict[str, Any]:
    """The JSON object of a frame body; anything else (including decoder failures) is ``bad_json``."""
    try:
        header = json.loads(body)
    except Exception as exc:  # UnicodeDecodeError, JSONDecodeError, RecursionError, int digit limit
        why = f"{type(exc).__name__}: {str(exc)[:200]}"
        raise ProtocolError("bad_json", f"frame is not JSON: {why}") from None
    if not isinstance(header, dict):
        raise ProtocolError("bad_json", "frame header must be a JSON object")
    return header


def recv_frame(
    sock: socket.socket,
    limit: int = MAX_FRAME_BYTES,
    *,
    idle_timeout_s: float | None = None,
    frame_timeout_s: float | None = None,
) -> tuple[dict[str, Any], list[int]]:
    """Read one frame; returns (header, fds). The caller owns (and must close) the fds.

    Raises ``PeerClosed`` on a clean close between frames and ``ProtocolError`` on anything invalid
    or late; on error every fd received so far is closed. Without timeouts the socket's own applies.
    """
    fds: list[int] = []
    clock = _Clock(idle_timeout_s, frame_timeout_s)
    try:
        (length,) = _PREFIX.unpack(_recv_exact(sock, _PREFIX.size, fds, clock, at_start=True))
        if length > limit:
            raise ProtocolError("too_large", f"frame of {length} bytes exceeds the limit of {limit}")
        header = decode_header(_recv_exact(sock, length, fds, clock, at_start=False))
        nfds = header.get("nfds", 0)
        if type(nfds) is not int or nfds != len(fds):
            raise ProtocolError("bad_fds", f"header announces {str(nfds)[:20]} fds, got {len(fds)}")
        return header, fds
    except BaseException:
        for fd in fds:
            os.close(fd)
        raise


def error_reply(code: str, message: str) -> dict[str, Any]:
    return {"ok": False, "error": {"code": code, "message": message}}
