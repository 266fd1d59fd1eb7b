"""server/listener.py: the API socket bound as `keepwarm serve` starts is the one served on; a port in
use leaves the bind (and its error) to the supervising parent."""

from __future__ import annotations

import socket
from collections.abc import Iterator

import pytest

from keepwarm_runtime.server import listener


@pytest.fixture(autouse=True)
def _no_early_socket() -> Iterator[None]:
    listener.give_up()
    yield
    listener.give_up()


def _port() -> int:
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        return probe.getsockname()[1]


def test_the_early_socket_is_taken_for_its_port_only() -> None:
    port = _port()
    listener.bind_early("127.0.0.1", port)
    early = listener.held()
    assert early is not None and early.getsockname() == ("127.0.0.1", port)
    listener.bind_early("127.0.0.1", port)  # held already: no second bind (it would fail: in use)
    assert listener.held() is early
    assert listener.take(port) is early and listener.held() is None
    early.close()
    listener.bind_early("127.0.0.1", port)
    other = listener.held()
    assert listener.take(port + 1) is None and other.fileno() == -1  # another port: closed


def test_a_port_in_use_leaves_the_bind_to_the_supervisor(caplog) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        with caplog.at_level("INFO", logger="keepwarm_runtime.server.listener"):
            listener.bind_early("127.0.0.1", taken.getsockname()[1])
    assert listener.held() is None and "the API port is bound later" in caplog.text


def test_an_adopted_socket_replaces_the_one_held() -> None:
    listener.bind_early("127.0.0.1", _port())
    first = listener.held()
    with socket.socket() as other:
        other.bind(("127.0.0.1", 0))
        other.listen()
        listener.adopt(other)
        assert first.fileno() == -1 and listener.take(other.getsockname()[1]) is other
