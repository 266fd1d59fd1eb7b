"""snapshot/handover.py: the restored parent receives the very socket its launcher bound, with the
connections queued on it; no other process gets it, and a wait for one ends when told."""

from __future__ import annotations

import os
import socket
import threading

from keepwarm_runtime.snapshot import handover


def test_the_socket_handed_over_is_the_one_bound_and_queued_connections_survive() -> None:
    bound = socket.socket()  # the launcher's early socket (launcher and parent: one process here)
    bound.bind(("127.0.0.1", 0))
    bound.listen()
    port = bound.getsockname()[1]
    client = socket.create_connection(("127.0.0.1", port))  # queued before the hand-over, as a probe
    offer = handover.Offer()
    went: list[bool] = []
    sender = threading.Thread(target=lambda: went.append(offer.hand_over(bound, os.getpid(), 30)))
    sender.start()
    received = handover.receive(offer.address)
    sender.join(30)
    bound.close()  # the launcher keeps no copy once it went
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
        offer = handover.Offer()
        went: list[bool] = []
        sender = threading.Thread(target=lambda: went.append(offer.hand_over(api, os.getpid() + 1, 1)))
        sender.start()
        assert handover.receive(offer.address) is None  # this pid is not the one offered to
        sender.join(30)
    assert went == [False]


def test_a_readable_stop_descriptor_ends_the_wait() -> None:
    read_end, write_end = os.pipe()
    os.write(write_end, b"x")  # the restored parent answered, or died, without asking
    with socket.socket() as api:
        api.bind(("127.0.0.1", 0))
        api.listen()
        assert handover.Offer().hand_over(api, os.getpid(), 600, stop_fd=read_end) is False
    os.close(read_end)
    os.close(write_end)
