"""The supervising parent's pure parts: backoff, exit descriptions, addresses, and one real fork."""

from __future__ import annotations

import os
import selectors
import signal
import time

import pytest

from keepwarm_runtime.server.supervisor import (
    backoff_delay,
    bind_listener,
    describe_exit,
    fork_hazards,
    local_address,
)
from keepwarm_runtime.server.worker_probe import PENDING, HealthProbe, engine_state


def test_the_first_restart_in_a_row_is_immediate_then_the_wait_doubles_up_to_the_cap():
    assert [backoff_delay(n, 0.5, 4.0) for n in range(1, 8)] == [0.0, 0.5, 1.0, 2.0, 4.0, 4.0, 4.0]


def _status_of(child_action) -> int:
    pid = os.fork()
    if pid == 0:
        child_action()
        os._exit(0)
    return os.waitpid(pid, 0)[1]


def test_exits_are_described_by_signal_or_code():
    assert describe_exit(_status_of(lambda: os.kill(os.getpid(), signal.SIGKILL))) == "killed by SIGKILL"
    assert describe_exit(_status_of(lambda: os._exit(3))) == "exited with 3"


@pytest.mark.parametrize(
    ("host", "expected"), [("0.0.0.0", "127.0.0.1"), ("::", "::1"), ("127.0.0.2", "127.0.0.2")]
)
def test_the_parent_reaches_a_wildcard_listener_on_loopback(host, expected):
    assert local_address(host) == expected


def test_a_taken_port_is_an_error_and_leaks_no_socket():
    with bind_listener("127.0.0.1", 0) as first:
        before = len(os.listdir("/proc/self/fd"))
        with pytest.raises(OSError):
            bind_listener("127.0.0.1", first.getsockname()[1])
        assert len(os.listdir("/proc/self/fd")) == before


def test_the_engine_state_is_read_from_a_health_answer():
    answer = b'HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n\r\n{"engine": "failed"}'
    assert engine_state(answer) == "failed"
    assert engine_state(b"HTTP/1.1 200 OK\r\n\r\nnot json") is None
    assert engine_state(b"HTTP/1.1 200 OK\r\n") is None  # cut off before the body


def _drive(probe: HealthProbe, selector: selectors.BaseSelector, seconds: float) -> str | None:
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        for key, mask in selector.select(0.05):
            result = key.data.on_event(mask)
            if result != PENDING:
                return result
    return PENDING


def test_a_probe_never_blocks_on_a_listener_nobody_accepts_and_reads_an_answer():
    selector = selectors.DefaultSelector()
    with bind_listener("127.0.0.1", 0) as listener:
        address = listener.getsockname()
        silent = HealthProbe(address, selector)
        silent.start()
        assert _drive(silent, selector, 0.3) == PENDING  # in the backlog: the loop carried on
        conn, _ = listener.accept()
        with conn:
            assert conn.recv(4096).startswith(b"GET /health")
            conn.sendall(b'HTTP/1.1 200 OK\r\nconnection: close\r\n\r\n{"engine": "ready"}')
        assert _drive(silent, selector, 5) == "ready"
    refused = HealthProbe(address, selector)  # the listener is closed now
    refused.start()
    assert _drive(refused, selector, 5) is None
    selector.close()


def test_a_second_thread_is_a_fork_hazard():
    import threading

    release = threading.Event()
    thread = threading.Thread(target=release.wait)
    thread.start()
    try:
        assert any("threads" in hazard for hazard in fork_hazards())
    finally:
        release.set()
        thread.join()
