"""Hostile and unlucky clients against a real daemon: idle floods, fd exhaustion, drips, restart storms."""

from __future__ import annotations

import os
import signal
import socket
import struct
import threading
import time
from pathlib import Path

import pytest
import torch

from keepwarm_runtime.cache import protocol
from keepwarm_runtime.cache.client import attach, connect


def fd_count(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def thread_count(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("Threads:")))


def open_idle(socket_path: Path, n: int) -> list[socket.socket]:
    """``n`` connections that never send a byte (each connect succeeds into the listen backlog)."""
    out = []
    for _ in range(n):
        s = socket.socket(socket.AF_UNIX)
        s.connect(str(socket_path))
        out.append(s)
    return out


@pytest.fixture(scope="module")
def model(tmp_path_factory, checkpoint_writer) -> Path:
    return checkpoint_writer(tmp_path_factory.mktemp("limits") / "small", seed=7)


def test_300_idle_connections_under_256_fds(model, daemon_factory, tmp_path, assert_cached):
    daemon = daemon_factory(tmp_path / "wc", [model], nofile=256).wait_ready()
    idle = open_idle(daemon.socket, 300)
    try:
        time.sleep(1.0)  # let the daemon accept (and refuse) them all; they then count as idle
        res = attach(model, tmp_path / "wc", dtype=torch.bfloat16, timeout_s=30)
        assert_cached(res, model, torch.bfloat16)
        assert daemon.proc.poll() is None
        assert fd_count(daemon.proc.pid) < 256
        assert "busy connections" in daemon.stderr  # the flood met the per-uid cap
    finally:
        for s in idle:
            s.close()


def test_emfile_backs_off_and_keeps_serving(model, daemon_factory, tmp_path, assert_cached):
    # Caps above the descriptor limit: accept() itself runs out of fds.
    daemon = daemon_factory(
        tmp_path / "wc",
        [model],
        "--max-connections",
        "1000",
        "--max-connections-per-uid",
        "1000",
        nofile=256,
    ).wait_ready()
    idle = open_idle(daemon.socket, 300)
    try:
        deadline = time.monotonic() + 60
        while "Too many open files" not in daemon.stderr:
            assert time.monotonic() < deadline, daemon.stderr
            time.sleep(0.1)
        time.sleep(1.0)
        assert daemon.proc.poll() is None
        assert daemon.stderr.count("accept failed") <= 12  # rate-limited, not a flood
        for s in idle[:100]:
            s.close()
        res = attach(model, tmp_path / "wc", dtype=torch.bfloat16, timeout_s=30)
        assert_cached(res, model, torch.bfloat16)
    finally:
        for s in idle:
            s.close()
    assert "Traceback" not in daemon.stderr


def test_dripping_client_is_cut_at_the_request_deadline(model, daemon_factory, tmp_path):
    daemon = daemon_factory(tmp_path / "wc", [model], "--request-deadline", "1.5").wait_ready()
    body = b'{"cmd": "hello", "padding": "' + b"x" * 200 + b'"}'
    frame = struct.pack(">I", len(body)) + body
    with socket.socket(socket.AF_UNIX) as s:
        s.connect(str(daemon.socket))
        started, sent = time.monotonic(), 0
        reply = None
        s.settimeout(0.3)  # one byte every 0.3 s: each read alone is well inside any timeout
        while sent < len(frame):
            try:
                s.send(frame[sent : sent + 1])
            except OSError:  # the daemon replied and closed between our reads: its reply is buffered
                s.settimeout(5)
                reply, _ = protocol.recv_frame(s)
                break
            sent += 1
            try:
                reply, _ = protocol.recv_frame(s)
                break
            except TimeoutError:
                continue
        elapsed = time.monotonic() - started
    assert reply is not None and reply["error"]["code"] == "deadline", reply
    assert sent < len(frame) and elapsed < 30
    assert daemon.proc.poll() is None


def test_64_clients_while_the_daemon_is_paused(model, daemon_factory, tmp_path):
    daemon = daemon_factory(tmp_path / "wc", [model]).wait_ready()
    results: list = [None] * 64

    def one(i: int) -> None:
        res = attach(model, tmp_path / "wc", dtype=torch.bfloat16, timeout_s=30)
        results[i] = (res.source, res.reason)

    os.kill(daemon.proc.pid, signal.SIGSTOP)
    try:
        threads = [threading.Thread(target=one, args=(i,)) for i in range(64)]
        for t in threads:
            t.start()
        time.sleep(1.0)
    finally:
        os.kill(daemon.proc.pid, signal.SIGCONT)
    for t in threads:
        t.join(60)
    assert results == [("cache", None)] * 64


def test_client_retries_a_full_backlog_and_a_refusing_socket(tmp_path):
    """EAGAIN (backlog full) and ECONNREFUSED (socket file, no listener yet) wait for the timeout."""
    (tmp_path / "d").mkdir(mode=0o700)
    path = tmp_path / "d" / "host.sock"
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(str(path))
    listener.listen(0)
    queued = open_idle(path, 1)
    probe = socket.socket(socket.AF_UNIX)
    probe.setblocking(False)
    with pytest.raises(BlockingIOError):  # what a client without retries saw: fall back at once
        probe.connect(str(path))
    probe.close()

    def drain_later() -> None:
        time.sleep(0.5)
        for _ in range(2):
            listener.accept()[0].close()

    threading.Thread(target=drain_later, daemon=True).start()
    connect(path, timeout_s=10).close()
    listener.close()
    for s in queued:
        s.close()

    path.unlink()
    bound = socket.socket(socket.AF_UNIX)
    bound.bind(str(path))  # the file exists, nobody listens: ECONNREFUSED
    threading.Timer(0.5, bound.listen, args=(8,)).start()
    connect(path, timeout_s=10).close()
    bound.close()
