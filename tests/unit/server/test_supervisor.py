"""The supervising parent's pure parts: backoff, exit descriptions, addresses, and one real fork."""

from __future__ import annotations

import os
import signal

import pytest

from keepwarm_runtime.server.supervisor import backoff_delay, bind_listener, describe_exit, local_address


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
