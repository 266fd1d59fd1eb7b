"""Framing over a real socketpair: round trips with fds, and every way a frame can be bad."""

from __future__ import annotations

import os
import socket
import struct

import pytest

from keepwarm_runtime.cache import protocol


@pytest.fixture
def pair():
    a, b = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    yield a, b
    a.close()
    b.close()


def test_round_trip_with_fds(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        protocol.send_frame(a, {"cmd": "hello", "x": [1, 2]}, [r])
        header, fds = protocol.recv_frame(b)
        assert header == {"cmd": "hello", "x": [1, 2], "nfds": 1}
        assert len(fds) == 1
        os.write(w, b"ping")
        assert os.read(fds[0], 4) == b"ping"  # the received fd is the same pipe
        os.close(fds[0])
    finally:
        os.close(r)
        os.close(w)


def test_two_frames_in_a_row(pair):
    a, b = pair
    protocol.send_frame(a, {"n": 1})
    protocol.send_frame(a, {"n": 2})
    assert protocol.recv_frame(b)[0]["n"] == 1
    assert protocol.recv_frame(b)[0]["n"] == 2


def test_oversized_frame_rejected_before_reading_body(pair):
    a, b = pair
    a.sendall(struct.pack(">I", protocol.MAX_REQUEST_BYTES + 1))
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.recv_frame(b, protocol.MAX_REQUEST_BYTES)
    assert info.value.code == "too_large"


def test_sender_refuses_oversized_frame():
    with pytest.raises(protocol.ProtocolError):
        protocol.encode({"b": "x" * 100}, limit=10)


def test_garbage_is_bad_json(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 5) + b"\xff\x00abc")
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.recv_frame(b)
    assert info.value.code == "bad_json"


def test_non_object_json_rejected(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 2) + b"[]")
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.recv_frame(b)
    assert info.value.code == "bad_json"


def test_truncated_frame(pair):
    a, b = pair
    a.sendall(struct.pack(">I", 100) + b'{"cmd":')
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.recv_frame(b)
    assert info.value.code == "truncated"


def test_clean_close_between_frames(pair):
    a, b = pair
    a.shutdown(socket.SHUT_WR)
    with pytest.raises(protocol.PeerClosed):
        protocol.recv_frame(b)


def test_fd_count_must_match_header(pair):
    a, b = pair
    r, w = os.pipe()
    try:
        data = protocol.encode({"cmd": "x", "nfds": 0})
        socket.send_fds(a, [data], [r])
        with pytest.raises(protocol.ProtocolError) as info:
            protocol.recv_frame(b)
        assert info.value.code == "bad_fds"
    finally:
        os.close(r)
        os.close(w)


@pytest.mark.parametrize(
    "body",
    [
        b"[" * 60000,  # RecursionError inside json
        b'{"n": ' + b"9" * 5000 + b"}",  # ValueError: integer string too long
        b"\xff\xfe\x00",  # not UTF-8
        b'{"a": NaN',
    ],
)
def test_every_decoder_failure_is_bad_json(pair, body):
    a, b = pair
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.recv_frame(b, protocol.MAX_REQUEST_BYTES)
    assert info.value.code == "bad_json"


def test_nfds_must_be_an_integer(pair):
    a, b = pair
    body = b'{"cmd": "hello", "nfds": "0"}'
    a.sendall(struct.pack(">I", len(body)) + body)
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.recv_frame(b)
    assert info.value.code == "bad_fds"


def test_deadline_covers_the_whole_frame(pair):
    """Bytes that keep trickling in do not extend the frame's deadline (each read alone is quick)."""
    import threading

    a, b = pair
    stop = threading.Event()

    def drip() -> None:
        a.sendall(struct.pack(">I", 100))
        while not stop.wait(0.05):
            a.sendall(b" ")

    threading.Thread(target=drip, daemon=True).start()
    try:
        with pytest.raises(protocol.ProtocolError) as info:
            protocol.recv_frame(b, idle_timeout_s=5.0, frame_timeout_s=0.5)
        assert info.value.code == "deadline"
    finally:
        stop.set()


def test_idle_between_frames(pair):
    _, b = pair
    with pytest.raises(protocol.ProtocolError) as info:
        protocol.recv_frame(b, idle_timeout_s=0.1, frame_timeout_s=5.0)
    assert info.value.code == "idle"


def test_without_limits_the_socket_timeout_applies(pair):
    _, b = pair
    b.settimeout(0.05)
    with pytest.raises(TimeoutError):
        protocol.recv_frame(b)
