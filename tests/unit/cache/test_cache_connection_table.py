"""Connection limits: per uid and overall, the longest-idle connection gives way, else ``busy``."""

from __future__ import annotations

import socket
import time

import pytest

from keepwarm_runtime.cache import limits
from keepwarm_runtime.cache.limits import ConnectionTable, connection_cap


@pytest.fixture
def socks():
    made: list[socket.socket] = []

    def make() -> tuple[socket.socket, socket.socket]:
        a, b = socket.socketpair()
        made.extend((a, b))
        return a, b

    yield make
    for s in made:
        s.close()


def test_per_uid_cap_refuses_busy_newcomers(socks):
    table = ConnectionTable(max_total=10, max_per_uid=2)
    ids = [table.admit(1000, socks()[0])[0] for _ in range(2)]
    assert None not in ids
    conn_id, why = table.admit(1000, socks()[0])
    assert conn_id is None and "per-uid" in why
    assert table.admit(1001, socks()[0])[0] is not None  # other uids are not affected


def test_longest_idle_connection_gives_way(socks, monkeypatch):
    monkeypatch.setattr(limits, "RECLAIM_AFTER_S", 0.05)
    table = ConnectionTable(max_total=2, max_per_uid=2)
    (old, old_peer), (new, _) = socks(), socks()
    old_id, _ = table.admit(1000, old)
    busy_id, _ = table.admit(1000, new)
    assert table.waiting(old_id, idle=True) and table.waiting(busy_id, idle=False)
    time.sleep(0.1)
    newcomer, why = table.admit(1000, socks()[0])
    assert newcomer is not None, why
    assert old_peer.recv(1) == b""  # the idle one was shut down
    assert not table.waiting(old_id, idle=True)  # and its thread learns it was reclaimed
    assert table.total() == 2
    assert table.admit(1000, socks()[0])[0] is None  # the rest are busy: refused


def test_connection_cap_follows_the_fd_limit():
    assert connection_cap(None, 256) == (256 - limits.FD_RESERVE) // 2
    assert connection_cap(None, 1 << 20) == limits.DEFAULT_MAX_CONNECTIONS
    assert connection_cap(1000, 256) == 1000  # an explicit cap is taken as given


def test_soft_open_files_limit_is_raised_to_the_hard_limit():
    import subprocess
    import sys

    script = (
        "import resource\n"
        "resource.setrlimit(resource.RLIMIT_NOFILE, (100, 4000))\n"
        "from keepwarm_runtime.cache.limits import raise_nofile_limit\n"
        "print(raise_nofile_limit(), resource.getrlimit(resource.RLIMIT_NOFILE)[0])\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, timeout=60
    )
    assert out.stdout.split() == ["4000", "4000"]
