"""Hand-off records and streams (cache/handoff.py): versioned, typed, and never leaking a descriptor."""

from __future__ import annotations

import os
import socket
from pathlib import Path

import pytest

from keepwarm_runtime.cache import protocol
from keepwarm_runtime.cache.handoff import (
    ArenaRecord,
    HandoffRefused,
    check_format,
    recv_stream,
    send_stream,
    shard_identities,
)


def record(**overrides) -> dict:
    base = {
        "name": "m",
        "path": "/models/m",
        "key": {"dtype": "bfloat16"},
        "digest": "ab" * 32,
        "tier": "host",
        "gpu_uuid": None,
        "page_mode": "4k",
        "size": 4096,
        "tensors": [["a.weight", "bfloat16", [2, 2], 0, 8]],
        "files": [["model.safetensors", [1, 2, 3, 4, 5]]],
        "pinned": False,
        "quantization": None,
        "load_seconds": 0.5,
        "hits": 3,
        "idle_s": 1.25,
    }
    return {**base, **overrides}


def test_record_round_trips_and_refuses_missing_or_mistyped_fields():
    assert ArenaRecord.from_wire(record()).to_wire() == record()
    with pytest.raises(HandoffRefused, match="lacks 'digest'"):
        ArenaRecord.from_wire({k: v for k, v in record().items() if k != "digest"})
    with pytest.raises(HandoffRefused, match="'hits' has the wrong type"):
        ArenaRecord.from_wire(record(hits=True))  # a bool is not a count
    with pytest.raises(HandoffRefused, match="'size' has the wrong type"):
        ArenaRecord.from_wire(record(size="4096"))
    with pytest.raises(HandoffRefused, match="not a JSON object"):
        ArenaRecord.from_wire([])


def test_another_format_is_refused_by_name():
    check_format({"format": 1})
    with pytest.raises(HandoffRefused, match=r"arena record format 2 is not one this daemon reads \(1\)"):
        check_format({"format": 2})
    with pytest.raises(HandoffRefused, match="format None"):
        check_format({})


def test_shard_names_must_be_plain_file_names():
    rec = ArenaRecord.from_wire(record())
    assert shard_identities(rec, Path("/models/m")) == {Path("/models/m/model.safetensors"): (1, 2, 3, 4, 5)}
    bad = ArenaRecord.from_wire(record(files=[["../etc/passwd", [1, 2, 3, 4, 5]]]))
    with pytest.raises(HandoffRefused, match="not a plain file name"):
        shard_identities(bad, Path("/models/m"))
    with pytest.raises(HandoffRefused, match=r"not \[name, identity\]"):
        shard_identities(ArenaRecord.from_wire(record(files=[["x"]])), Path("/models/m"))


def _open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def test_stream_carries_each_arena_fd_and_the_closing_fds():
    a, b = socket.socketpair()
    memfd = os.memfd_create("keepwarm:test")
    os.write(memfd, b"weights")
    try:
        send_stream(a, {"format": 1}, [(record(), memfd)], [memfd])
        stream = recv_stream(b)
        assert stream.head["count"] == 1 and stream.items[0][0] == record()
        got = stream.items[0][1]
        assert os.pread(got, 7, 0) == b"weights" and len(stream.final_fds) == 1
        stream.close()
        assert stream.items[0][1] == -1 and stream.final_fds == []
    finally:
        os.close(memfd)
        a.close()
        b.close()


def test_a_broken_stream_closes_every_descriptor_it_received():
    a, b = socket.socketpair()
    memfd = os.memfd_create("keepwarm:test")
    try:
        before = _open_fds()
        protocol.send_frame(a, {"ok": True, "format": 1, "count": 2})
        protocol.send_frame(a, {"arena": record()}, [memfd])
        protocol.send_frame(a, {"arena": record(name="n")})  # no descriptor: refused
        with pytest.raises(HandoffRefused, match="one record and one descriptor"):
            recv_stream(b)
        assert _open_fds() == before
        protocol.send_frame(a, protocol.error_reply("forbidden", "uid 65534 is a client"))
        with pytest.raises(HandoffRefused, match="forbidden: uid 65534 is a client"):
            recv_stream(b)
        protocol.send_frame(a, {"ok": True, "count": 10**9})
        with pytest.raises(HandoffRefused, match="announces 1000000000 records"):
            recv_stream(b)
    finally:
        os.close(memfd)
        a.close()
        b.close()
