"""What a daemon hands its successor (or deposits in the holder): one record per arena, versioned.

A record is the arena's descriptor plus what the successor needs to serve it without reading the
checkpoint: the model's name and directory, its key, content digest, tensor table, the shard file
identities it was loaded from, pin, size, page mode and budget accounting (hits, seconds since last
use). ``RECORD_FORMAT`` versions that record; a reader refuses any other format by name
(``HandoffRefused``) and the successor then loads from disk instead.

On the wire the records travel as a *stream* on one connection (``send_stream``/``recv_stream``)::

    {"ok": true, "format": F, "count": N, ...}           head: format, record count, who sends
    {"arena": {record}}             + 1 fd               N times (one arena, one memfd / VMM handle)
    {"done": true}                  + k fds              the sender's listener and lock (hand-off only)

Records are JSON and descriptors are SCM_RIGHTS, like every other frame (``protocol.py``): nothing
is unpickled. The descriptors are duplicates: the sender keeps serving its own until it commits.
"""

from __future__ import annotations

import os
import socket
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from keepwarm_runtime.cache import protocol

if TYPE_CHECKING:
    from keepwarm_runtime.cache.registry import ResidentModel

RECORD_FORMAT = 1  # bump when a field of ArenaRecord changes meaning; readers refuse other formats
READABLE_FORMATS = (RECORD_FORMAT,)
STREAM_TIMEOUT_S = 30.0  # one stream, from its head to its last frame (local socket, small frames)


class HandoffRefused(Exception):
    """A hand-off (or a holder's records) this daemon will not take; the message says why."""


@dataclass(frozen=True)
class ArenaRecord:
    """One arena as handed over (format 1). The successor re-checks every field it can."""

    name: str  # the daemon's model name
    path: str  # checkpoint directory it was loaded from
    key: dict[str, Any]  # WeightCacheKey.to_dict() as loaded
    digest: str  # sha256 of the bytes read at load
    tier: str  # "host" | "gpu"
    gpu_uuid: str | None  # gpu tier: the GPU holding it
    page_mode: str  # "4k" | "thp" | "hugetlb" | "vmm"
    size: int  # arena bytes (page-rounded)
    tensors: list[list[Any]]  # TensorEntry.to_wire() rows
    files: list[list[Any]]  # [shard file name, [device, inode, size, mtime_ns, ctime_ns]] as loaded
    pinned: bool
    quantization: str | None  # online quantization applied at load ("fp8")
    load_seconds: float
    hits: int
    idle_s: float  # seconds since its last hit when handed over (LRU order survives)

    def to_wire(self) -> dict[str, Any]:
        return {name: getattr(self, name) for name in self.__dataclass_fields__}

    @classmethod
    def from_wire(cls, data: Any) -> ArenaRecord:
        """Parse a record of ``RECORD_FORMAT``; a missing or mistyped field raises HandoffRefused."""
        if not isinstance(data, dict):
            raise HandoffRefused("an arena record is not a JSON object")
        kinds: dict[str, tuple[type, ...]] = {
            "name": (str,),
            "path": (str,),
            "key": (dict,),
            "digest": (str,),
            "tier": (str,),
            "gpu_uuid": (str, type(None)),
            "page_mode": (str,),
            "size": (int,),
            "tensors": (list,),
            "files": (list,),
            "pinned": (bool,),
            "quantization": (str, type(None)),
            "load_seconds": (int, float),
            "hits": (int,),
            "idle_s": (int, float),
        }
        for name, allowed in kinds.items():
            if name not in data:
                raise HandoffRefused(f"arena record lacks {name!r}")
            value = data[name]
            if not isinstance(value, allowed) or (isinstance(value, bool) and bool not in allowed):
                raise HandoffRefused(f"arena record field {name!r} has the wrong type")
        return cls(**{name: data[name] for name in kinds})


def record_of(model: ResidentModel, now: float | None = None) -> ArenaRecord:
    """The record of a resident model (the arena's fd travels beside it)."""
    now = time.monotonic() if now is None else now
    return ArenaRecord(
        name=model.name,
        path=str(model.path),
        key=model.key.to_dict(),
        digest=model.digest,
        tier=model.tier,
        gpu_uuid=model.gpu_uuid,
        page_mode=model.arena.page_mode,
        size=model.nbytes,
        tensors=model.tensors,
        files=[[s.path.name, list(s.identity.as_tuple())] for s in model.shards],
        pinned=model.pinned,
        quantization=model.quantization,
        load_seconds=model.load_seconds,
        hits=model.hits,
        idle_s=max(0.0, now - model.last_used),
    )


def check_format(head: dict[str, Any], readable: tuple[int, ...] = READABLE_FORMATS) -> None:
    """Refuse, by name, records of a format this daemon does not read."""
    fmt = head.get("format")
    if fmt not in readable:
        reads = ", ".join(map(str, readable))
        raise HandoffRefused(f"arena record format {str(fmt)[:20]} is not one this daemon reads ({reads})")


@dataclass
class Stream:
    """A received stream: its head, the records with their fds (owned by the receiver), the last fds."""

    head: dict[str, Any]
    items: list[tuple[dict[str, Any], int]]  # (raw record, fd)
    final_fds: list[int]

    def close(self) -> None:
        """Close every descriptor still held (those adopted were set to -1 by the taker)."""
        for i, (record, fd) in enumerate(self.items):
            if fd >= 0:
                os.close(fd)
            self.items[i] = (record, -1)
        for fd in self.final_fds:
            if fd >= 0:
                os.close(fd)
        self.final_fds = []


def send_stream(
    sock: socket.socket,
    head: dict[str, Any],
    items: list[tuple[dict[str, Any], int]],
    final_fds: Sequence[int] = (),
) -> None:
    """Send a head, one frame per (record, fd) and the closing frame; fds are sent, not closed."""
    protocol.send_frame(sock, {"ok": True, **head, "count": len(items)})
    for record, fd in items:
        protocol.send_frame(sock, {"arena": record}, [fd])
    protocol.send_frame(sock, {"done": True}, list(final_fds))


def recv_stream(sock: socket.socket, max_items: int = 4096) -> Stream:
    """Receive a stream (the head may be an error reply: HandoffRefused with its code and message).

    On any failure every descriptor received so far is closed before the exception leaves.
    """
    head, fds = protocol.recv_frame(sock, frame_timeout_s=STREAM_TIMEOUT_S)
    for fd in fds:
        os.close(fd)
    if not head.get("ok"):
        err = head.get("error") or {}
        raise HandoffRefused(f"{err.get('code', '?')}: {err.get('message', '')}")
    count = head.get("count")
    if type(count) is not int or not 0 <= count <= max_items:
        raise HandoffRefused(f"stream announces {str(count)[:20]} records")
    stream = Stream(head, [], [])
    try:
        for _ in range(count):
            frame, fds = protocol.recv_frame(sock, frame_timeout_s=STREAM_TIMEOUT_S)
            if len(fds) != 1 or "arena" not in frame:
                for fd in fds:
                    os.close(fd)
                raise HandoffRefused("an arena frame must carry one record and one descriptor")
            stream.items.append((frame["arena"], fds[0]))
        frame, fds = protocol.recv_frame(sock, frame_timeout_s=STREAM_TIMEOUT_S)
        stream.final_fds = fds
        if not frame.get("done"):
            raise HandoffRefused("the stream did not end with its closing frame")
    except BaseException:
        stream.close()
        raise
    return stream


def shard_identities(record: ArenaRecord, model_dir: Path) -> dict[Path, tuple[int, ...]]:
    """The record's shard identities by path (a file name with a slash is refused)."""
    out: dict[Path, tuple[int, ...]] = {}
    for row in record.files:
        if not (isinstance(row, list) and len(row) == 2 and isinstance(row[0], str)) or not isinstance(
            row[1], list
        ):
            raise HandoffRefused(f"{record.name}: a shard row is not [name, identity]")
        name, ident = row
        if "/" in name or name in ("", ".", ".."):
            raise HandoffRefused(f"{record.name}: shard name {name!r} is not a plain file name")
        out[model_dir / name] = tuple(int(x) for x in ident)
    return out
