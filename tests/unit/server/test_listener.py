"""server/listener.py: the API socket bound at start is the one served on, in the same process or in
a restored parent it is handed to; no other process gets it, and a wait for one ends when told."""

from __future__ import annotations

import os
import socket
import threading
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


def test_the_socket_handed_over_is_the_one_bound_and_queued_connections_survive() -> None:
    bound = socket.socket()  # the launcher's early socket (launcher and parent: one process here)
    bound.bind(("127.0.0.1", 0))
    bound.listen()
    port = bound.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))  # queued before the hand-over, as a probe
    offer = listener.Offer()
    went: list[bool] = []
    sender = threading.Thread(target=lambda: went.append(offer.hand_over(bound, os.getpid(), 30)))
    sender.start()
    assert listener.receive(offer.address)
    sender.join(30)
    bound.close()  # the launcher keeps no copy once it went
    received = listener.take(port)
    assert went == [True] and received is not None and received.getsockname() == ("127.0.0.1", port)
    conn, _ = received.accept()  # the connection made before the hand-over
    client.sendall(b"ping")
    assert conn.recv(4) == b"ping"
    for s in (conn, client, received):
        s.close()


def test_no_other_process_gets_the_socket() -> None:
    with socket.socket() as api:
        api.bind(("127.0.0.1", 0))
        api.listen()
        offer = listener.Offer()
        went: list[bool] = []
        sender = threading.Thread(target=lambda: went.append(offer.hand_over(api, os.getpid() + 1, 1)))
        sender.start()
        assert not listener.receive(offer.address)  # this pid is not the one offered to
        sender.join(30)
    assert went == [False] and listener.held() is None


def test_a_readable_stop_descriptor_ends_the_wait() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"x")  # the restored parent answered, or died, without asking
    with socket.socket() as api:
        api.bind(("127.0.0.1", 0))
        api.listen()
        assert listener.Offer().hand_over(api, os.getpid(), 600, stop_fd=read_end) is False
    os.close(read_end)
    os.close(write_end)
