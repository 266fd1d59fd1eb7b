"""snapshot/wire.py: the messages across a checkpoint round-trip, and anything else is refused."""

from __future__ import annotations

import json
import os
from dataclasses import replace

import pytest

from keepwarm_runtime.snapshot.wire import (
    MAX_CONTEXT_BYTES,
    Context,
    MappedFile,
    Ready,
    WireError,
    read_all,
    read_line,
)

CONTEXT = Context(
    argv=("keepwarm", "serve", "/models/m"),
    env={"A": "1"},
    cwd="/home/keepwarm",
    umask=0o022,
    started_at=1.0,
    restore_started_at=2.0,
    key_digest="ab" * 16,
    log_level="DEBUG",
    rlimits={"RLIMIT_NOFILE": [1024, 4096]},
    listener="keepwarm-listener-00ff",
)


def test_ready_and_context_round_trip() -> None:
    ready = Ready(41, 3.5, (MappedFile("/usr/lib/libc.so.6", 10, 20),))
    assert Ready.decode(ready.encode()) == ready
    assert Context.decode(CONTEXT.encode()) == CONTEXT
    without = replace(CONTEXT, listener=None)  # a launcher that bound no API socket
    assert Context.decode(without.encode()) == without


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[]",
        json.dumps({"argv": "keepwarm serve"}).encode(),
        json.dumps({**json.loads(CONTEXT.encode()), "env": {"A": 1}}).encode(),
        json.dumps({**json.loads(CONTEXT.encode()), "argv": ["a", 2]}).encode(),
        json.dumps({**json.loads(CONTEXT.encode()), "umask": "x"}).encode(),
    ],
)
def test_a_context_that_is_not_one_is_refused(data: bytes) -> None:
    with pytest.raises(WireError):
        Context.decode(data)


def test_a_ready_message_that_is_not_one_is_refused() -> None:
    with pytest.raises(WireError, match="pid"):
        Ready.decode(json.dumps({"pid": 1}).encode())


def test_an_oversized_context_is_refused_on_both_sides() -> None:
    big = Context(("k",), {"A": "x" * MAX_CONTEXT_BYTES}, "/", 0, 0.0, 0.0, "d")
    with pytest.raises(WireError, match="at most"):
        big.encode()
    r, w = os.pipe()
    os.write(w, b"x" * 100)
    os.close(w)
    with pytest.raises(WireError, match="more than 10 bytes"):
        read_all(r, 10)
    os.close(r)


def test_read_line_stops_at_the_line_or_at_eof() -> None:
    r, w = os.pipe()
    os.write(w, b'{"pid": 1}\n')
    assert read_line(r, 100) == b'{"pid": 1}\n'
    os.close(w)
    assert read_line(r, 100) == b""
    os.close(r)
