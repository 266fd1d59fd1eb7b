"""The messages that cross a checkpoint, and the descriptors they travel on.

A parent prepared for a snapshot (server/checkpoint.py) holds exactly these descriptors: 0
(/dev/null), 1 and 2 (pipes: its stdout and stderr), a control pipe it reads and a ready pipe it
writes (their numbers are its arguments). It writes one ``Ready`` line on the ready pipe once
preloaded and then blocks reading the control pipe: that is the checkpoint point, where the agent
dumps it. A launcher restores it with its own pipes in place of all four (criu.py), writes one
``Context`` to the control pipe and closes it; the restored parent takes the context, answers
RESUMED on the ready pipe and goes on as `keepwarm serve`. An EOF before any context (the agent
gave up before dumping) ends the prepared parent quietly.

Each message is one JSON object; a context is at most MAX_CONTEXT_BYTES. Nothing is unpickled.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from typing import Any

MAX_CONTEXT_BYTES = 4 << 20  # argv + environment of a pod
MAX_READY_BYTES = 1 << 20
RESUMED = b"resumed\n"


class WireError(ValueError):
    """A message that is not what its side expects; the text says what."""


@dataclass(frozen=True)
class MappedFile:
    """A file the prepared parent maps (a shared library, an extension module, the interpreter): a
    restore maps it again by path, so it must be the same file there."""

    path: str
    size: int
    mtime_ns: int


@dataclass(frozen=True)
class Ready:
    """What the prepared parent says at the checkpoint point."""

    pid: int  # its pid (CRIU restores it with the same one)
    preload_s: float  # seconds its preload took
    mapped: tuple[MappedFile, ...] = ()  # every file it maps

    def encode(self) -> bytes:
        return (json.dumps(asdict(self)) + "\n").encode()

    @classmethod
    def decode(cls, data: bytes) -> Ready:
        obj = _object(data, "ready message")
        try:
            mapped = tuple(
                MappedFile(str(m["path"]), int(m["size"]), int(m["mtime_ns"])) for m in obj["mapped"]
            )
            return cls(int(obj["pid"]), float(obj["preload_s"]), mapped)
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"a ready message needs pid, preload_s and mapped: {exc}") from None


@dataclass(frozen=True)
class Context:
    """A pod's start, handed to the parent it restored: everything per-pod it must take afresh."""

    argv: tuple[str, ...]  # the launcher's sys.argv (`keepwarm serve ...`)
    env: dict[str, str]  # the launcher's whole environment
    cwd: str  # the launcher's working directory
    umask: int
    started_at: float  # time.time() when the launcher's process started (the pod's start)
    restore_started_at: float  # time.time() when the restore began
    key_digest: str  # the snapshot restored (store directory name)
    log_level: str = "INFO"  # keepwarm's --log-level, for logging's set-up after the restore
    rlimits: dict[str, list[int]] = field(default_factory=dict)  # resource limit name -> [soft, hard]
    listener: str | None = None  # where the launcher hands over the API socket (server/listener.py)

    def encode(self) -> bytes:
        data = json.dumps(asdict(self)).encode()
        if len(data) > MAX_CONTEXT_BYTES:
            raise WireError(f"the context is {len(data)} bytes; at most {MAX_CONTEXT_BYTES}")
        return data

    @classmethod
    def decode(cls, data: bytes) -> Context:
        obj = _object(data, "context")
        try:
            env = obj["env"]
            if not isinstance(env, dict) or not all(
                isinstance(k, str) and isinstance(v, str) for k, v in env.items()
            ):
                raise TypeError("env must map strings to strings")
            argv = obj["argv"]
            if not isinstance(argv, list) or not all(isinstance(a, str) for a in argv):
                raise TypeError("argv must be a list of strings")
            return cls(
                tuple(argv), env, str(obj["cwd"]), int(obj["umask"]), float(obj["started_at"]),
                float(obj["restore_started_at"]), str(obj["key_digest"]), str(obj.get("log_level", "INFO")),
                {str(k): [int(v[0]), int(v[1])] for k, v in dict(obj.get("rlimits") or {}).items()},
                None if obj.get("listener") is None else str(obj["listener"]),
            )  # fmt: skip
        except (KeyError, TypeError, ValueError) as exc:
            raise WireError(f"not a restore context: {exc}") from None


def read_all(fd: int, limit: int) -> bytes:
    """Everything ``fd`` gives until EOF; WireError past ``limit`` bytes."""
    chunks, size = [], 0
    while True:
        chunk = os.read(fd, 65536)
        if not chunk:
            return b"".join(chunks)
        size += len(chunk)
        if size > limit:
            raise WireError(f"more than {limit} bytes")
        chunks.append(chunk)


def read_line(fd: int, limit: int) -> bytes:
    """One line from ``fd``, or what came before EOF (the writer sends nothing after its line)."""
    data = bytearray()
    while not data.endswith(b"\n"):
        chunk = os.read(fd, 65536)
        if not chunk:
            break
        data += chunk
        if len(data) > limit:
            raise WireError(f"a line longer than {limit} bytes")
    return bytes(data)


def write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def _object(data: bytes, what: str) -> dict[str, Any]:
    try:
        obj = json.loads(data)
    except ValueError as exc:
        raise WireError(f"the {what} is not JSON: {exc}") from None
    if not isinstance(obj, dict):
        raise WireError(f"the {what} is not a JSON object")
    return obj
